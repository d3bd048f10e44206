# SPDX-License-Identifier: Apache-2.0
"""vToken's settings for the TensorRT-LLM path, and the LLM-API settings vToken requires.

``VTokenSettings`` travels from the client process to the executor worker (which TensorRT-LLM
spawns with MPI even at TP=1) as JSON in ``$VTOKEN_TRTLLM_SETTINGS``: patches made in the client do
not reach the worker, environment variables do.

``check_llm_args`` validates the LLM arguments (a ``TorchLlmArgs``-like object or a plain mapping,
e.g. a Triton ``model.yaml``) against what the hooks need, naming every violation at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from trtllm_vtoken.config_base import from_dict
from trtllm_vtoken.policies import Budget, make_policy
from trtllm_vtoken.reclaim.config import ReclaimConfig

ENV_VAR = "VTOKEN_TRTLLM_SETTINGS"


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
    """Where the worker publishes vToken's counters for the Triton model's metrics ("" = nowhere)."""
    stats_interval_s: float = 0.5

    def __post_init__(self) -> None:
        ReclaimConfig(self.mode, self.fragmentation_threshold, self.check_invariants)
        if self.positions not in ("keep", "shift"):
            raise ValueError(f"positions must be 'keep' or 'shift', got {self.positions!r}")
        if self.stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be positive, got {self.stats_interval_s}")
        if self.mode != "dense":
            raise ValueError("the TensorRT-LLM path supports mode 'dense' only: its attention kernels have "
                             "no per-token mask, so holes below kv_len would be attended")
        self.make_policy()  # ValueError / KeyError for a bad policy, budget or option

    def make_policy(self):
        return make_policy(self.policy, Budget.parse(self.budget), **self.policy_options)

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VTokenSettings:
        """The settings the client exported; defaults if none. ValueError for malformed JSON."""
        raw = (environ if environ is not None else os.environ).get(ENV_VAR)
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"${ENV_VAR} is not valid JSON: {exc}") from None
        return from_dict(cls, values)


# (dotted path in the LLM args, required value, why)
REQUIRED: tuple[tuple[str, Any, str], ...] = (
    ("kv_cache_config.enable_block_reuse", False, "compaction rewrites blocks that reuse would share"),
    ("kv_cache_config.enable_partial_reuse", False, "compaction rewrites blocks that reuse would share"),
    ("kv_cache_config.host_cache_size", (None, 0), "offload streams would race the relocation copies"),
    ("kv_cache_config.max_attention_window", None, "window detachment moves the block list's front"),
    ("kv_cache_config.sink_token_length", (None, 0), "use the streaming_llm policy instead"),
    ("max_beam_width", (None, 1), "rewind_kv_cache needs beam width 1"),
    ("speculative_config", None, "speculative decoding assumes logical = physical KV length"),
    ("disable_overlap_scheduler", True, "batch N+1 must not be prepared before N's evictions"),
    ("scheduler_config.capacity_scheduler_policy", "MAX_UTILIZATION",
     "GUARANTEED_NO_EVICT reserves full-length blocks and never credits reclaimed ones"),
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
