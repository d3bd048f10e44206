# SPDX-License-Identifier: Apache-2.0
"""Engine settings: one frozen dataclass, validated on construction; unknown keys are errors."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from trtllm_vtoken.config_base import from_dict, require_positive
from trtllm_vtoken.policies import POLICIES, Budget, make_policy
from trtllm_vtoken.policies.request_settings import PolicySpec
from trtllm_vtoken.runtime.drafting import NGramDecodingConfig

VARIANTS = ("native", "naive-evict", "vtoken")
Variant = Literal["native", "naive-evict", "vtoken"]


@dataclass(frozen=True)
class EngineConfig:
    variant: Variant = "vtoken"
    """"native": full retention. "naive-evict": the policy's dead tokens are masked in place and
    only blocks with no live token are freed. "vtoken": dead slots are refilled by relocation."""
    mode: Literal["dense", "lazy"] = "dense"
    """vtoken only: "dense" compacts every step (no attention mask needed), "lazy" masks holes and
    compacts past ``fragmentation_threshold`` or under memory pressure (fewer free blocks than the
    batch may need for its next tokens)."""
    lazy_background: bool = True
    """Lazy mode: a compaction copies in the background (the next forward does not wait for it)
    and commits at a later step, once its copy has finished. False: it commits in its own step.
    Shift positions always commit in the compaction's own step (the keys turn back right after it)."""
    positions: Literal["keep", "shift"] = "keep"
    """"keep": cached keys keep their original rotation, new tokens are rotated by their logical
    position. "shift": new tokens are rotated by their physical position (kv_len) and compaction
    re-rotates the surviving keys (reclaim/rerotate.py), as kernels without a position input need."""
    policy: str = "h2o"
    budget: int | float | str = 0.5
    """Live tokens kept per request: a count (``256``) or a retention ratio (``0.5``)."""
    policy_options: dict[str, Any] = field(default_factory=dict)
    """The engine's policy is the default: a request may bring its own (``SamplingParams.eviction``)."""
    eviction_unit: int = 1
    """Tokens a request gives up at a time (``Budget.unit``; its own budget too). ``tokens_per_block``
    decides as every TensorRT-LLM host does (whole blocks at a time)."""
    tokens_per_block: int = 16
    num_blocks: int = 512
    """The KV block budget: blocks in the pool, shared by all requests."""
    max_batch_size: int = 32
    max_seq_len: int = 2048
    """Prompt plus output tokens of one request, at most."""
    admission: Literal["peak", "greedy"] = "peak"
    """"peak": admit only if every running request can still reach its peak block demand (no
    preemption in steady state). "greedy": admit whenever the prompt fits now; preempt and
    recompute when the pool runs dry."""
    evacuation_headroom: int = 0
    prefix_caching: bool = True
    """Automatic prefix caching, on by default as in TensorRT-LLM (``enable_block_reuse``), vLLM
    and SGLang: a prompt's full blocks are keyed by their tokens; a request whose prompt starts
    with cached blocks shares them and prefills only the rest; finished requests' blocks stay
    cached until the pool needs them. Shared blocks are protected from eviction and relocation."""
    prefix_reuse: Literal["copy", "share"] = "copy"
    """How a request that may evict reuses a cached prefix. "copy" (the default): into blocks of
    its own (one block copy per cached block, no prefill), and no other request shares its blocks
    while it runs, so nothing of its is protected and its decisions and output are those of a run
    without prefix caching, alone or in any batch. "share": the cached blocks are held in common
    and their tokens protected while shared: fewer blocks, but which tokens the policy may evict,
    and so a greedy answer, depends on what runs beside it (docs/prefix_caching.md)."""
    fragmentation_threshold: int = 1
    check_invariants: bool = False
    """Check I1/I2/I4 on every relocation (slower; on in tests)."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """The KV pool's dtype: "auto", the model's; "fp8", float8_e4m3fn codes with a scale per layer
    (TensorRT-LLM's FP8 KV cache, ``kv_cache.py``): a quarter of float32's bytes a block. Not with
    ``positions="shift"`` (re-rotating 8-bit codes rounds every surviving key again)."""
    batch_invariant: bool = False
    """Every product of a forward runs on a multiple of the row count this machine's BLAS needs
    (measured at start-up, ``runtime/batch_invariance.py``), and each batch row attends alone: a
    request's logits, and its decode steps' attention mass, are bitwise the same alone and in any
    batch, after a cached prefix or without one (a prefill over a cached prefix adds the prefix's
    stored mass to its own, another float grouping: its mass may differ in the last bits). CPU
    and one rank only; a lone decode row's linears run on four rows and a batch's attention loops
    over its rows (decode 1.2-1.5x slower)."""
    device: str = "cpu"
    cuda_graphs: bool = True
    """On a CUDA device, decode steps replay captured CUDA graphs (one per batch-size bucket);
    ignored on CPU."""
    relocation_kernel: Literal["auto", "cuda", "torch"] = "auto"
    """On CUDA: "auto" uses the CUDA relocation kernel when it is built, "cuda" requires it,
    "torch" copies with torch indexing."""
    step_impl: Literal["auto", "cpp", "python"] = "auto"
    """The step's token table (naive-evict, vtoken): "cpp" (the C++ core), "python" (the
    specification), or "auto" (cpp where it is built). ``vtoken info`` shows what auto picks."""
    step_threads: int = 0
    """C++ core: threads H2O's pass over the slots may split a batch over (``StepConfig.threads``;
    0, the default: automatic, the process's cores up to 4, one fewer beside sampling)."""
    step_overlap: bool = True
    """C++ core: the step's native call (decision, token table, layout) runs on the step's worker
    thread while the engine samples the batch (``DecodeStep.start``); False: it runs before
    sampling, on the engine's thread (for comparing both)."""
    overlap_scheduler: bool = True
    """The step of iteration N runs beside the forward of N+1, as TensorRT-LLM's overlap scheduler
    orders it (``runtime/overlap.py``, docs/overlap.md); every policy decides as in the plain
    order unless ``decode_decision`` / ``prefill_decision`` say "lagged" (naive-evict and vtoken
    alike). False: each iteration's step ends it (beside sampling).
    Speculative decoding turns it off, as TensorRT-LLM's executor creator does for NGram."""
    prefill_decision: Literal["at_once", "lagged"] = "at_once"
    """Overlap scheduler, policies that observe attention: "at_once" takes a new request's step
    (its prompt's eviction) before its first decode forward, as the plain order does (the engine
    has every forward's mass on the host already: it waits for nothing more); "lagged": beside
    that forward, one iteration late."""
    decode_decision: Literal["at_once", "lagged"] = "at_once"
    """Overlap scheduler, policies that observe attention, decode rows: "at_once" takes a row's
    step before the next forward wherever its counts say it may evict with the next token
    (``DecodeStep.may_evict``; the engine waits for that forward's mass), and beside the next
    forward where they say it cannot (the step then only takes tokens and mass in): the plain
    order's decisions and tokens. "lagged": every step beside the next forward, deciding from the
    mass of the forward before it (one iteration late). Either way a step beside the next forward
    takes that forward's tokens in unobserved (``StepInput.unobserved``): Scissorhands counts only
    the tokens the mass's forward attended."""
    max_num_tokens: int | None = None
    """Tokens one iteration computes at most: one per decode row, the rest prefill (TensorRT-LLM's
    name). Admission stops for the iteration when the next prompt (or, with chunked prefill, its
    first chunk) does not fit; without chunked prefill a longer prompt is refused. None: no limit."""
    enable_chunked_prefill: bool = False
    """Prefill a prompt longer than ``prefill_chunk_tokens`` over several iterations, one chunk an
    iteration beside the decode rows (TensorRT-LLM's name). Each chunk's step takes its tokens in
    and the policy evicts before the next chunk, so a request holds at most its budget plus one
    chunk (and a block) of KV whatever its prompt's length, and admission counts that peak: a
    prompt longer than the KV budget runs. With prefix caching a request that may evict takes a
    cached prefix up to its first chunk's end only (it decides there, as alone; native requests
    take all of it); with ``prefix_reuse="share"`` and greedy admission a newcomer does not share
    the blocks of a prompt that may evict and has chunks to come (``held_by_evicting_prompts``). In
    lazy mode with ``lazy_background``, plans commit at once while a prompt has chunks to come.
    Needs ``max_num_tokens`` and ``prefill_decision="at_once"``."""
    speculative_config: NGramDecodingConfig | dict | None = None
    """Speculative decoding with n-gram drafts (TensorRT-LLM's ``NGramDecodingConfig`` fields, or
    a dict of them with ``decoding_type="NGram"``): greedy decode rows verify up to
    ``max_draft_len`` draft tokens a step (``runtime/speculation.py``); with ``max_num_tokens`` each
    row at most its share of it (``draft_tokens_per_row``), and the drafts count in it before the
    prompts' chunks. It turns the overlap scheduler off (a warning says so), as TensorRT-LLM does
    for NGram:
    the drafts come from the tokens just sampled, and a step beside the next forward would take its
    drafts in before the forward has verified them."""
    synchronous_copies: bool = False
    """On CUDA: wait on the host for every relocation instead of ordering the compute stream
    after its event (the ablation of the asynchronous side-stream copy)."""
    seed: int = 0
    tensor_parallel_size: int = 1
    """Ranks the model is split over (attention by KV-head group, the MLP by intermediate
    features), one process each, started by ``LLM`` and ``vtoken generate --tp``; an ``Engine`` of
    size N runs inside one of them. Every rank keeps its own KV pool of ``num_blocks`` blocks (its
    heads only) and takes the same decisions (``trtllm_vtoken.consistency``)."""
    reduce_attention_mass: bool = True
    """With tensor_parallel_size > 1: sum the attention mass over all ranks before the policy
    scores (the consistency protocol). False only to measure the protocol's cost or to show what
    it prevents: ranks then score from their own heads and diverge."""

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.mode not in ("dense", "lazy"):
            raise ValueError(f"mode must be 'dense' or 'lazy', got {self.mode!r}")
        if self.positions not in ("keep", "shift"):
            raise ValueError(f"positions must be 'keep' or 'shift', got {self.positions!r}")
        if self.prefill_decision not in ("at_once", "lagged"):
            raise ValueError(f"prefill_decision must be 'at_once' or 'lagged', got {self.prefill_decision!r}")
        if self.decode_decision not in ("at_once", "lagged"):
            raise ValueError(f"decode_decision must be 'at_once' or 'lagged', got {self.decode_decision!r}")
        if "lagged" in (self.prefill_decision, self.decode_decision) and not self.overlap_scheduler:
            raise ValueError("a 'lagged' decision is taken beside the next forward, which only the overlap "
                             "scheduler runs: with overlap_scheduler=False every decision is taken at once")
        if self.prefix_reuse not in ("copy", "share"):
            raise ValueError(f"prefix_reuse must be 'copy' or 'share', got {self.prefix_reuse!r}")
        if self.admission not in ("peak", "greedy"):
            raise ValueError(f"admission must be 'peak' or 'greedy', got {self.admission!r}")
        if self.relocation_kernel not in ("auto", "cuda", "torch"):
            raise ValueError(f"relocation_kernel must be 'auto', 'cuda' or 'torch', got {self.relocation_kernel!r}")
        if self.step_impl not in ("auto", "cpp", "python"):
            raise ValueError(f"step_impl must be 'auto', 'cpp' or 'python', got {self.step_impl!r}")
        if self.step_threads < 0:
            raise ValueError(f"step_threads must be >= 0 (0: automatic), got {self.step_threads}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.batch_invariant and self.device != "cpu":
            raise ValueError(f"batch_invariant runs on the CPU (device {self.device!r}): on a GPU the libraries choose "
                             "kernels per batch shape that this mode does not control")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant runs on one rank: the all-reduce of 3 or more ranks sums each element "
                             "in an order set by the buffer's size, which follows the batch")
        if self.kv_cache_dtype == "fp8" and self.positions == "shift":
            raise ValueError("kv_cache_dtype='fp8' needs positions='keep': shift positions re-rotate the surviving "
                             "keys, which on 8-bit codes rounds each of them again at every compaction")
        require_positive(self, "tokens_per_block", "num_blocks", "max_batch_size", "eviction_unit",
                         "max_seq_len", "fragmentation_threshold", "tensor_parallel_size")
        if self.evacuation_headroom < 0 or self.evacuation_headroom >= self.num_blocks:
            raise ValueError(f"evacuation_headroom must lie in [0, num_blocks), got {self.evacuation_headroom}")
        if self.max_num_tokens is not None:
            require_positive(self, "max_num_tokens")
        object.__setattr__(self, "speculative_config", NGramDecodingConfig.of(self.speculative_config))
        if self.speculative_config is not None and self.overlap_scheduler:
            warnings.warn("speculative_config turns the overlap scheduler off (as TensorRT-LLM does for NGram: a "
                          "step beside the next forward would take its drafts in before they are verified)",
                          stacklevel=3)
            object.__setattr__(self, "overlap_scheduler", False)
        if self.speculative_config is not None and self.draft_tokens_per_row == 0:
            warnings.warn(f"speculative_config drafts nothing: max_num_tokens ({self.max_num_tokens}) leaves no draft "
                          f"token per row beside a full batch of {self.max_batch_size} decode rows "
                          "(draft_tokens_per_row)", stacklevel=3)
        if self.enable_chunked_prefill:
            if self.max_num_tokens is None:
                raise ValueError("enable_chunked_prefill needs max_num_tokens (the tokens of one iteration)")
            if self.max_num_tokens - self.max_batch_size < self.tokens_per_block:
                raise ValueError(f"max_num_tokens ({self.max_num_tokens}) must leave a block ({self.tokens_per_block} "
                                 f"tokens) for prefill chunks beside max_batch_size ({self.max_batch_size}) decode rows")
            if self.prefill_decision != "at_once":
                raise ValueError("enable_chunked_prefill needs prefill_decision='at_once' (each chunk is taken "
                                 "in before the next one runs)")
        POLICIES.get(self.policy)  # KeyError naming the known policies
        self.make_policy()  # ValueError for a bad budget or option

    def make_policy(self):
        return make_policy(self.policy, Budget.parse(self.budget).in_units(self.eviction_unit), **self.policy_options)

    def policy_spec(self) -> PolicySpec:
        """The engine's policy as a spec (what requests without settings of their own run with)."""
        return PolicySpec.of(self.policy, Budget.parse(self.budget).in_units(self.eviction_unit), self.policy_options)

    @property
    def prefill_chunk_tokens(self) -> int | None:
        """Tokens of each prefill chunk (None without chunked prefill): ``max_num_tokens`` less a
        full batch of decode rows, in whole blocks. Fixed per engine, so where a prompt is cut, and
        what its policy decides, does not depend on what runs beside it."""
        if not self.enable_chunked_prefill:
            return None
        return (self.max_num_tokens - self.max_batch_size) // self.tokens_per_block * self.tokens_per_block

    @property
    def draft_tokens_per_row(self) -> int:
        """Draft tokens a decode row may carry (0 without ``speculative_config``): its
        ``max_draft_len``, within an even share of ``max_num_tokens`` over a full batch of decode
        rows. Fixed per engine, so whether and how far a request drafts, and with eviction when
        its policy decides, does not depend on what runs beside it."""
        if self.speculative_config is None:
            return 0
        if self.max_num_tokens is None:
            return self.speculative_config.max_draft_len
        share = (self.max_num_tokens - self.max_batch_size) // self.max_batch_size
        return max(0, min(self.speculative_config.max_draft_len, share))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        return from_dict(cls, values)
