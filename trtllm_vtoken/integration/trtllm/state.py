# SPDX-License-Identifier: Apache-2.0
"""vToken's per-iteration work inside TensorRT-LLM's KV-cache manager, independent of its classes.

TensorRT-LLM's C++ manager owns the blocks; vToken keeps, per request, the token table over that
block list and runs the same batched step (``trtllm_vtoken.step.DecodeStep``: policy, table, one
copy, invariant checks) as the reference runtime. Per iteration (overlap scheduler off, so N's
update runs before N+1's prepare):

    prepare(N)            TensorRT-LLM allocates the new token (add_token) or the prompt
    ... forward N writes their KV; the decode queries are recorded for the attention mass ...
    run(N)                one step for the batch: the tables learn the new tokens and blocks, the
                          policy decides for every request at once, dense compaction relocates every
                          request's moves in one copy on the side stream (after forward N; the
                          execution stream waits on it, I3), and each request's ``lost`` physical
                          tokens go back through TensorRT-LLM's rewind_kv_cache
    num_evicted(req)      logical - physical tokens: subtracted from num_cached_tokens_per_seq
                          by the attention metadata, while position ids stay logical (RoPE rule)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import torch

from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput, StepOutput

CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1
"""TensorRT-LLM's id for the padding rows of a captured batch: always treated as empty."""


def make_step(settings: VTokenSettings, tokens_per_block: int, num_blocks: int,
              pools: Sequence[torch.Tensor] | None = None, rerotation: KeyRerotation | None = None,
              reduce_mass: Callable[[np.ndarray], np.ndarray] | None = None,
              shared_blocks: Callable[[], Collection[int]] | None = None) -> DecodeStep:
    """The step a TensorRT-LLM host with these settings runs (dense: its kernels have no mask; a
    request gives tokens up a whole block at a time, so its physical length stays congruent to
    its logical length modulo ``tokens_per_block`` and TensorRT-LLM's scheduler, which counts
    blocks from logical lengths, allocates exactly when the request needs a block);
    ``rerotation``: the key re-rotation pass of shift positions (the trtllm-build engine path);
    ``reduce_mass``: the cross-rank sum of the batch's mass (tensor / pipeline parallelism);
    ``shared_blocks``: the blocks that are or may become reusable (block reuse): never a source or
    destination of a move, their tokens never evicted."""
    config = StepConfig("dense", settings.fragmentation_threshold, settings.check_invariants, settings.step_impl)
    return DecodeStep(config, num_blocks, tokens_per_block, settings.make_policy(tokens_per_block),
                      TorchCopyExecutor(pools) if pools else None, reduce_mass=reduce_mass, rerotation=rerotation,
                      is_shared=(lambda block: block in shared_blocks()) if shared_blocks else None,
                      shared_blocks=shared_blocks)


def new_block_span(step: DecodeStep, req_id: int, written: int) -> slice:
    """Where, in a request's block list as TensorRT-LLM holds it, lie the blocks the step learns
    with ``written`` new tokens: after the table's own, up to the blocks of its physical length
    once they join. TensorRT-LLM may hold more (blocks allocated ahead: a prompt's later chunks,
    or the engine session's longest prompt); those stay outside the table::

        [ table's blocks | blocks of the written tokens | allocated ahead ]
                         `------------ this span ------'
    """
    start = step.num_blocks(req_id) if req_id in step else 0
    kv_len = step.kv_len(req_id) if req_id in step else 0
    return slice(start, -(-(kv_len + written) // step.tokens_per_block))


class VTokenState:
    """The step of one TensorRT-LLM KV-cache manager, and the glue its hooks need.

    Args:
        num_blocks: blocks in the manager's primary pool (block ids lie below it).
        pools: the manager's primary pools as 6-D HND views (``manager_pools``); None: metadata only.
        attention_mass: (rows (request id, positions attended, block ids), batch, width) -> the
            batch's mass [B, width] per position, float32, zero past each row's attended
            positions, for policies that observe attention; None if the policy needs none.
        reduce_mass: the batch's mass [B, L] -> its sum over every rank (``RankConsistency``).
        shared_blocks: () -> the blocks vToken must leave as they are (block reuse).
    """

    def __init__(self, settings: VTokenSettings, tokens_per_block: int, num_blocks: int,
                 pools: Sequence[torch.Tensor] | None = None,
                 attention_mass: Callable[..., np.ndarray] | None = None,
                 reduce_mass: Callable[[np.ndarray], np.ndarray] | None = None,
                 shared_blocks: Callable[[], Collection[int]] | None = None) -> None:
        self.settings = settings
        self.step = make_step(settings, tokens_per_block, num_blocks, pools, reduce_mass=reduce_mass,
                              shared_blocks=shared_blocks)
        self.policy = self.step.policy
        self.needs_attention = self.policy.observes_attention()
        if self.needs_attention and attention_mass is None:
            raise ValueError(f"policy {settings.policy!r} observes attention: pass attention_mass")
        self.attention_mass = attention_mass
        self.requests_seen = 0
        """Requests whose tokens the step has learnt (padding rows not counted)."""

    def run(self, written: Sequence[tuple[int, Sequence[int], int, int]], stream: Any = None,
            batch: Any = None) -> StepOutput | None:
        """After a batch's forward: one step for its requests, given as (request id, TensorRT-LLM's
        block list now, tokens written that the table does not know yet, positions the batch's
        forward attended to in the table's layout once they join). The table learns the blocks of
        the new tokens (``new_block_span``); blocks allocated ahead stay TensorRT-LLM's. New requests join;
        padding rows are skipped. ``batch``: the caller's record of the batch, passed to
        ``attention_mass`` as it is (the manager's ``PreparedBatch``: its recordings, its mass if
        enqueued). ``stream``: the execution stream (CUDA), made to wait on the copy."""
        rows = [(r, list(blocks), n, attended) for r, blocks, n, attended in written
                if r != CUDA_GRAPH_DUMMY_REQUEST_ID]
        if not rows:
            return None
        step = self.step
        # The new tokens past the positions the mass's forward attended: the overlap loop's update
        # takes the next batch's token in too. Once joined, a row's KV spans kv_len + n positions.
        unobserved = [(step.kv_len(r) if r in step else 0) + n - attended for r, _, n, attended in rows] \
            if self.needs_attention else None
        for req_id, *_ in rows:
            if req_id not in step:
                step.add_request(req_id)
                self.requests_seen += 1
        fresh = []
        for req_id, blocks, n, _ in rows:
            span = new_block_span(step, req_id, n)
            if len(blocks) < span.stop:
                raise RuntimeError(f"request {req_id}: TensorRT-LLM holds {len(blocks)} blocks for {span.stop} "
                                   "blocks of KV")
            fresh.append(blocks[span])
        mass = None
        if self.needs_attention:  # the batch's, in one call: [B, L] beside the rows, L their lengths once joined
            width = max(step.kv_len(r) + n for r, _, n, _ in rows)
            mass = self.attention_mass([(r, attended, blocks) for r, blocks, _, attended in rows], batch, width)
        return step.run(StepInput.of_lists([r for r, *_ in rows], [n for _, _, n, _ in rows], fresh, mass=mass,
                                           unobserved=unobserved, stream=stream))

    def may_evict_at(self, totals: Sequence[tuple[int, int]]) -> list[bool]:
        """Per (request id, its tokens written so far and in the next batch): could its step
        evict once they have all joined its table (``DecodeStep.may_evict``; a request the table
        does not know yet joins empty)? False means the step evicts nothing."""
        step = self.step
        known = [(r, n) for r, n in totals if r in step]
        out = dict(zip([r for r, _ in known], step.may_evict([r for r, _ in known],
                                                             [n - step.num_tokens(r) for r, n in known])))
        new = np.array([n for r, n in totals if r not in out], dtype=np.int64)
        if len(new):  # empty tables: every token live
            out.update(zip([r for r, _ in totals if r not in out], self.policy.wants_to_evict(new, new)))
        return [bool(out[r]) for r, _ in totals]

    def num_evicted(self, req_id: int) -> int:
        """Logical minus physical tokens: what attention metadata subtracts from the cached count."""
        if req_id not in self.step:
            return 0
        return self.step.num_tokens(req_id) - self.step.kv_len(req_id)

    def prompt_tokens_held(self, req_id: int, prompt_len: int) -> int:
        """Prompt tokens (logical ids below ``prompt_len``) still in the physical KV: the context
        length the attention op may be told, never more than the physical length (a request's
        live tokens all lie in ``[0, kv_len)``)."""
        if req_id not in self.step:
            return prompt_len
        return int(np.count_nonzero(self.step.live_tokens(req_id) < prompt_len))

    def forget(self, req_id: int) -> None:
        """The request left: TensorRT-LLM frees its blocks itself."""
        if req_id in self.step:
            self.step.remove_request(req_id)
