# SPDX-License-Identifier: Apache-2.0
"""vToken's settings for the TensorRT-LLM path, and the LLM-API settings vToken requires.

``VTokenSettings`` travel from the client process to the executor worker (which TensorRT-LLM
spawns with MPI even at TP=1) as two environment variables, $VTOKEN_TRTLLM (armed: "1" for vToken,
"rope" for its RoPE-only baseline) and $VTOKEN_TRTLLM_SETTINGS (JSON). Two routes carry them, and
which one works depends on the TensorRT-LLM build (``startup.py`` draws both, with the sources):

    TensorRT-LLM                    env_overrides field   worker applies it   route that works
    1.1 (TorchLlmArgs)              no                    -                   exported before import
    1.2 worker without the update   yes                   no                  exported before import
    1.2 as stored (1.2-era copies)  yes                   yes (worker_main)   both
    2026 main                       yes                   yes (and MPI env)   both

"Exported before import" means in the environment when ``import tensorrt_llm`` initialises MPI:
``vtoken_llm_args`` exports them itself, so calling it before that import works everywhere. Since
no installed TensorRT-LLM can be inspected here, the client does not rely on the table: every
``LLM`` built while armed reads the worker's record and fails if the worker did not arm
(``arming.py``). In the worker, armed without settings is an error, never a default.

``check_llm_args`` validates the LLM arguments (a ``TorchLlmArgs``-like object or a plain mapping,
e.g. a Triton ``model.yaml``) against what the hooks need, naming every violation at once; the
worker checks them again before the model is built.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from trtllm_vtoken.config_base import from_dict, require_positive_ints
from trtllm_vtoken.integration.trtllm.environment import ARM_VALUES, ARM_VAR, SETTINGS_VAR, armed
from trtllm_vtoken.policies import Budget, make_policy
from trtllm_vtoken.reclaim.config import ReclaimConfig
from trtllm_vtoken.step.core import IMPLS

ENV_VAR = SETTINGS_VAR


@dataclass(frozen=True)
class VTokenSettings:
    policy: str = "h2o"
    budget: int | float | str = 0.5
    """Live tokens per request: a count or a retention ratio."""
    policy_options: dict[str, Any] = field(default_factory=dict)
    mode: str = "dense"
    """TensorRT-LLM's kernels attend every position below kv_len: only "dense" is exact there."""
    positions: str = "keep"
    """"keep": keys keep their original rotation (the PyTorch backend, RoPE unfused, logical
    position ids). "shift": compaction re-rotates the surviving keys, for kernels that rotate by
    the physical length (the trtllm-build engine path, ``engine_runner.py``)."""
    fragmentation_threshold: int = 1
    check_invariants: bool = False
    stats_file: str = ""
    """Where the worker publishes its record (proof that it armed, ``arming.py``) and vToken's
    counters for the Triton model's metrics ("" = nowhere; ``vtoken_llm_args`` always gives one)."""
    stats_interval_s: float = 0.5
    step_impl: str = "auto"
    """The step's token table: "cpp" (the C++ core), "python", or "auto" (cpp where built)."""
    decode_decision: str = "at_once"
    """TensorRT-LLM's overlap loop, policies that observe attention: "at_once" steps a batch's
    requests whose step may evict (``DecodeStep.may_evict``) in the next batch's
    ``prepare_resources``, before its forward (the host waits for the batch's own forward and
    mass, not the next one's); the others in ``update_resources`` beside the next forward, with
    the batch's own tokens only, where they evict nothing: the plain loop's decisions. "lagged":
    every step in ``update_resources``, one iteration late (the host never waits on a forward's
    mass before launching the next forward). The plain loop decides at once either way."""
    mass_workspace_mib: int = 64
    """The most transient memory one attention-mass pass (H2O, Scissorhands) holds, in MiB: in the
    forward's prefill hook (and so in ``KvCacheCreator``'s estimation forward) and in
    ``update_resources`` (``mass_plan.py``)."""

    def __post_init__(self) -> None:
        ReclaimConfig(self.mode, self.fragmentation_threshold, self.check_invariants)
        if self.step_impl not in IMPLS:
            raise ValueError(f"step_impl must be one of {IMPLS}, got {self.step_impl!r}")
        if self.positions not in ("keep", "shift"):
            raise ValueError(f"positions must be 'keep' or 'shift', got {self.positions!r}")
        if self.decode_decision not in ("at_once", "lagged"):
            raise ValueError(f"decode_decision must be 'at_once' or 'lagged', got {self.decode_decision!r}")
        require_positive_ints(mass_workspace_mib=self.mass_workspace_mib)
        if self.stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be positive, got {self.stats_interval_s}")
        if self.mode != "dense":
            raise ValueError("the TensorRT-LLM path supports mode 'dense' only: its attention kernels have "
                             "no per-token mask, so holes below kv_len would be attended")
        self.make_policy()  # ValueError / KeyError for a bad policy, budget or option

    def make_policy(self, tokens_per_block: int = 1):
        """The policy; with ``tokens_per_block``, one that gives tokens up a whole block at a time
        (``Budget.unit``): what every TensorRT-LLM host needs, whose scheduler counts a request's
        blocks from its logical length."""
        return make_policy(self.policy, Budget.parse(self.budget).in_units(tokens_per_block), **self.policy_options)

    def with_stats_file(self) -> VTokenSettings:
        """These settings, or with a fresh temporary stats file if they have none."""
        if self.stats_file:
            return self
        return replace(self, stats_file=str(Path(tempfile.mkdtemp(prefix="vtoken-worker-")) / "stats.json"))

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def worker_environment(self, mode: str = "vtoken") -> dict[str, str]:
        """The variables that arm the executor worker and carry these settings there. ``mode``:
        "vtoken", or "rope" (unfused RoPE only, TensorRT-LLM's own KV-cache manager: a baseline)."""
        values = {m: v for v, m in ARM_VALUES.items()}
        if mode not in values:
            raise ValueError(f"mode must be one of {sorted(values)}, got {mode!r}")
        return {ARM_VAR: values[mode], SETTINGS_VAR: self.to_env()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VTokenSettings:
        """The settings the client sent. RuntimeError when they are missing (vToken never runs on
        defaults nobody chose); ValueError for malformed JSON or an unknown key."""
        env = os.environ if environ is None else environ
        raw = env.get(SETTINGS_VAR)
        if not raw:
            state = f"armed (${ARM_VAR}={env.get(ARM_VAR)})" if armed(env) else "installed"
            raise RuntimeError(
                f"vToken is {state} in process {os.getpid()} but ${SETTINGS_VAR} is not set: pass the LLM "
                "arguments vtoken_llm_args(...) returns (their env_overrides carry the settings into "
                f"TensorRT-LLM's executor worker), or export ${ARM_VAR} and ${SETTINGS_VAR} before Python starts")
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"${SETTINGS_VAR} is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"${SETTINGS_VAR} must be a JSON object, got {type(values).__name__}")
        return from_dict(cls, values)


# (dotted path in the LLM args, required value, why)
REQUIRED: tuple[tuple[str, Any, str], ...] = (
    ("kv_cache_config.host_cache_size", (None, 0), "offload streams would race the relocation copies"),
    ("kv_cache_config.max_attention_window", None, "window detachment moves the block list's front"),
    ("kv_cache_config.dtype", (None, "auto", "fp8"),
     "NVFP4 KV keeps per-block scales in a second pool, which vToken's relocation does not move with the codes"),
    ("kv_cache_config.sink_token_length", (None, 0), "use the streaming_llm policy instead"),
    ("max_beam_width", (None, 1), "rewind_kv_cache needs beam width 1"),
    ("speculative_config.decoding_type", (None, "NGram"),
     "only NGram's drafts are written into the target's KV cache and rewound by update_resources as "
     "vToken's step expects; two-model drafting keeps a second KV-cache manager vToken does not drive, and "
     "MTP / Eagle3 one-model write drafts vToken's query recorder does not read"),
    ("scheduler_config.capacity_scheduler_policy", "MAX_UTILIZATION",
     "GUARANTEED_NO_EVICT reserves full-length blocks and never credits reclaimed ones"),
    ("kv_connector_config", None, "a KV connector forces GUARANTEED_NO_EVICT (py_executor_creator.py)"),
    ("pipeline_parallel_size", (None, 1),
     "TensorRT-LLM's pipeline-parallel loop (_executor_loop_pp) never frees or resets the requests "
     "MAX_UTILIZATION pauses (TensorRT-LLM issue #18115): they keep their blocks while the scheduler has "
     "counted them free, so the batch it admitted can find none; use tensor parallelism"),
    ("attn_backend", (None, "TRTLLM"), "the hooks patch TrtllmAttention and its metadata"),
    ("sparse_attention_config", None, "sparse attention brings its own KV-cache manager"),
    ("cache_transceiver_config", None,
     "disaggregated serving sends a context request's blocks asynchronously while vToken may compact or "
     "rewind them, and generation-only requests never reach update_resources; serve aggregated"),
    ("torch_compile_config.enable_piecewise_cuda_graph", (None, False),
     "piecewise CUDA graphs pad the batch's tokens, so the decode rows' queries are not where vToken's "
     "recorder reads them; use cuda_graph_config (whole-batch graphs) instead"),
)


def _lookup(args: Any, dotted: str) -> Any:
    value = args
    for part in dotted.split("."):
        if value is None:
            return None
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
    name = getattr(value, "name", None)  # enums (CapacitySchedulerPolicy.MAX_UTILIZATION)
    return name if isinstance(name, str) and not isinstance(value, str) else value


def check_llm_args(args: Any) -> None:
    """Raises ValueError listing every required setting that ``args`` violates."""
    problems = []
    for dotted, wanted, why in REQUIRED:
        value = _lookup(args, dotted)
        allowed = wanted if isinstance(wanted, tuple) else (wanted,)
        if value not in allowed:
            shown = " or ".join(repr(a) for a in allowed)
            problems.append(f"{dotted} must be {shown} (got {value!r}): {why}")
    if problems:
        raise ValueError("vToken cannot run with these TensorRT-LLM settings:\n  " + "\n  ".join(problems))
