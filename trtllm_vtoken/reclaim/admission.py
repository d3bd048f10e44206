# SPDX-License-Identifier: Apache-2.0
"""Headroom-aware admission: admit a request only if every running request can still reach its
peak block demand, with what reclamation frees credited and its headroom reserved.

Each running request ``r`` reserves ``max(0, peak(r) - held(r))`` blocks of the free pool, where
``peak`` is the most blocks it can ever hold from now on:

    native, naive-evict   ceil((logical_len + remaining) / B)      no block is guaranteed to die
    vtoken dense          ceil(min(live + remaining, max(live, budget) + S) / B)
                          (live never exceeds the budget by more than the S tokens written before
                          the step's eviction: 1 while decoding, a chunk while a prompt is
                          prefilled in chunks, 2 before a first decode step the overlap
                          scheduler defers; compaction keeps exactly ceil(live / B) blocks)
    vtoken lazy           as dense + fragmentation_threshold blocks, and never more than
                          native's: holes are tolerated up to the threshold before compaction
                          runs, but compaction takes no block of its own, so a request holds no
                          more blocks than its tokens, evicted ones included, fill

plus ``evacuation_headroom`` blocks kept free for the whole pool, so a relocation never needs a
block that is not there. With prefix caching, cached blocks no request holds count as free (they
are reclaimed on demand), and a new request's prompt blocks found in the cache need no new block.
Because ``peak`` follows the eviction budget, blocks that compaction returns to the pool are
credited to admission at once, instead of being re-reserved as in a reservation based on the
logical length.

``peak_blocks`` is the demand formula of the reference runtime's admission.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from trtllm_vtoken.core.block_pool import BlockPool

Variant = Literal["native", "naive-evict", "vtoken"]


@dataclass(frozen=True)
class AdmissionConfig:
    variant: Variant = "vtoken"
    mode: Literal["dense", "lazy"] = "dense"
    fragmentation_threshold: int = 1
    """Lazy mode: blocks a request may hold beyond the ideal before it is compacted."""
    evacuation_headroom: int = 0
    """Blocks kept free for the whole pool (for relocations that need a fresh destination)."""

    def __post_init__(self) -> None:
        if self.variant not in ("native", "naive-evict", "vtoken"):
            raise ValueError(f"variant must be native, naive-evict or vtoken, got {self.variant!r}")
        if self.mode not in ("dense", "lazy"):
            raise ValueError(f"mode must be 'dense' or 'lazy', got {self.mode!r}")
        if self.fragmentation_threshold < 1 or self.evacuation_headroom < 0:
            raise ValueError("fragmentation_threshold must be >= 1 and evacuation_headroom >= 0")


@dataclass
class RequestState:
    """What admission knows of one running request, updated by the engine every step."""

    logical_len: int
    live: int
    remaining: int
    """Tokens still to be generated (max_new_tokens minus generated so far)."""
    budget: int | None
    """Live-token budget at completion (None: no eviction)."""
    held: int = 0
    step_tokens: int = 1
    """Most tokens it writes in one step before an eviction: 1 while decoding, a chunk while its
    prompt is prefilled in chunks."""


class AdmissionController:
    """Tracks running requests' reservations against one block pool."""

    def __init__(self, pool: BlockPool, config: AdmissionConfig | None = None,
                 reclaimable: Callable[[], int] | None = None) -> None:
        """``reclaimable``: blocks not free but freed on demand (cached blocks no request holds)."""
        self.pool = pool
        self.config = config or AdmissionConfig()
        self.reclaimable = reclaimable or (lambda: 0)
        self.running: dict[int, RequestState] = {}

    def peak_blocks(self, state: RequestState) -> int:
        """Most blocks the request can hold from now to completion (see module docstring)."""
        cfg = self.config
        return peak_blocks(self.pool.tokens_per_block, state.logical_len, state.live, state.remaining,
                           state.budget if cfg.variant == "vtoken" else None,
                           cfg.fragmentation_threshold if cfg.mode == "lazy" else 0, state.step_tokens)

    def reserved_blocks(self) -> int:
        """Free blocks promised to running requests, plus the evacuation headroom."""
        growth = sum(max(0, self.peak_blocks(s) - s.held) for s in self.running.values())
        return growth + self.config.evacuation_headroom

    def available_blocks(self) -> int:
        """Free blocks a new request may take: free (and reclaimable) minus reserved (may be
        negative)."""
        return self.pool.num_free + self.reclaimable() - self.reserved_blocks()

    def can_admit(self, prompt_len: int, max_new_tokens: int, budget: int | None, cached_blocks: int = 0,
                  cached_reclaimable: int = 0, step_tokens: int = 1) -> bool:
        """Would a new request fit? Its peak is the whole prompt (prefill writes it all before the
        first eviction) or its steady-state peak, whichever is larger; ``cached_blocks`` of it
        exist already (its cached prefix), ``cached_reclaimable`` of those count as reclaimable
        now and stop being so once it holds them. A prompt prefilled in chunks: ``prompt_len`` is
        its first chunk, ``max_new_tokens`` counts the rest of it, ``step_tokens`` is the chunk."""
        if prompt_len <= 0 or max_new_tokens <= 0:
            raise ValueError(f"prompt_len ({prompt_len}) and max_new_tokens ({max_new_tokens}) must be positive")
        state = RequestState(prompt_len, prompt_len, max_new_tokens, budget, step_tokens=step_tokens)
        need = self.peak_blocks(state) - cached_blocks
        return need <= self.available_blocks() - cached_reclaimable

    def admit(
        self, req_id: int, prompt_len: int, max_new_tokens: int, budget: int | None, force: bool = False,
        cached_blocks: int = 0, cached_reclaimable: int = 0, step_tokens: int = 1,
    ) -> bool:
        """Registers the request if it fits; False (changing nothing) if it does not.

        ``force`` registers it regardless (greedy admission, which preempts instead of reserving):
        its reservation then shows in ``reserved_blocks`` and may drive ``available_blocks`` below 0.
        """
        if req_id in self.running:
            raise ValueError(f"request {req_id} is already admitted")
        if not force and not self.can_admit(prompt_len, max_new_tokens, budget, cached_blocks, cached_reclaimable,
                                            step_tokens):
            return False
        self.running[req_id] = RequestState(prompt_len, prompt_len, max_new_tokens, budget, held=cached_blocks,
                                            step_tokens=step_tokens)
        return True

    def update(self, req_id: int, *, logical_len: int, live: int, remaining: int, held: int,
               step_tokens: int = 1) -> None:
        """Records a running request's progress after a step (and after its reclamation)."""
        state = self._state(req_id)
        state.logical_len, state.live, state.remaining, state.held = logical_len, live, remaining, held
        state.step_tokens = step_tokens

    def finish(self, req_id: int) -> None:
        """Drops a finished, cancelled or preempted request's reservation."""
        self._state(req_id)
        del self.running[req_id]

    def _state(self, req_id: int) -> RequestState:
        try:
            return self.running[req_id]
        except KeyError:
            raise KeyError(f"request {req_id} is not admitted") from None


def peak_blocks(tokens_per_block: int, logical_len: int, live: int, remaining: int, budget: int | None,
                extra_blocks: int = 0, step_tokens: int = 1) -> int:
    """Most blocks a request can hold from now to completion (the module docstring's formula).

    Args:
        logical_len / live: its tokens so far, and those still live (a new request: its prompt).
        remaining: tokens it may still generate.
        budget: live tokens its policy keeps at completion; None when nothing is evicted.
        extra_blocks: lazy compaction's tolerance (its fragmentation threshold).
        step_tokens: most tokens written in one step before an eviction (a prefill chunk, else 1).
    """
    whole = _ceil(logical_len + remaining, tokens_per_block)  # every token it ever writes
    if budget is None:
        return whole
    # At least the whole prompt: prefill writes it before the first eviction.
    peak_live = min(live + remaining, max(live, budget) + step_tokens)
    return min(whole, _ceil(peak_live, tokens_per_block) + extra_blocks)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
