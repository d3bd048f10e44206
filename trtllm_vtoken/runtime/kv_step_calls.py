# SPDX-License-Identifier: Apache-2.0
"""The reference KV-cache manager's step calls (``KVCacheManager``): the forward's tables for a
batch, then the one batched step (``trtllm_vtoken.step``) begun after the forward and completed
later, so that its native call can run beside the engine's sampling:

    set_batch(rows)       block_offsets / kv_lens (and the validity mask) for the forward
    start_step(rows, ..)  the forward's tokens join; the step evicts, compacts, copies
    finish_step()         the step completed; the blocks it released are freed
"""

from __future__ import annotations

import time

import numpy as np
import torch

from trtllm_vtoken.step import StepInput, StepOutput


class KVStepCalls:
    """Step calls of ``KVCacheManager`` (a mixin: it reads the manager's ``config``, ``cache``,
    ``writes``, ``step`` or ``lists``, ``layout``, ``pool``, ``prefix``, ``admission``,
    ``needs_attention``, ``lag_start``, ``step_drafts``, ``stats`` and ``evictions``, and keeps the
    step in flight in ``_stepping`` / ``_finished``)."""

    def set_batch(self, req_ids: list[int]) -> torch.Tensor | None:
        """Writes the rows' block lists and lengths (with their reserved tokens) into the cache's
        static tables. Returns the validity mask [B, max_blocks * tpb] when dead tokens may still
        sit below kv_len (naive-evict, lazy mode), else None."""
        if self.cache is None:
            return None
        rows = [self.writes.staged_blocks(r) for r in req_ids]
        self.cache.set_batch([blocks for blocks, _ in rows], [length for _, length in rows])
        if not self.masks_positions:
            return None
        start = time.perf_counter()
        width = self.cache.block_offsets.shape[1] * self.config.tokens_per_block
        valid = np.zeros((len(req_ids), width), bool)
        held = self.step.batch_tokens(req_ids) >= 0  # live tokens at the positions already written
        valid[:, : min(held.shape[1], width)] = held[:, :width]
        for i, req_id in enumerate(req_ids):
            valid[i, self.layout.kv_len(req_id) : rows[i][1]] = True  # this step's new tokens
        self.stats.mask_seconds += time.perf_counter() - start
        return torch.from_numpy(valid).to(self.cache.pool.device)

    @property
    def masks_positions(self) -> bool:
        """Dead tokens may sit below kv_len (naive-evict, lazy mode): attention needs a mask."""
        return self.step is not None and self.step.config.compaction != "dense"

    def step_batch(self, req_ids: list[int], mass=None) -> StepOutput | None:
        """The iteration's end for these requests at once: ``start_step`` then ``finish_step``."""
        self.start_step(req_ids, mass)
        return self.finish_step()

    def start_step(self, req_ids: list[int], mass=None, overlap: bool = False, forward_between: bool = False,
                   prompt_goes_on: bool = False, unobserved: list[int] | None = None) -> None:
        """The iteration's end for the requests the forward ran: their written tokens join
        (native: the block lists); the step evicts and compacts (one copy for all). ``overlap``:
        the step's native call may run beside the engine's next work (``DecodeStep.start``)
        until ``finish_step``, which frees the released blocks; a release in between waits for it.
        ``forward_between``: a forward runs before ``finish_step`` that writes the batch's newest
        tokens; the step's copy waits for ``finish_step`` (``DecodeStep.start``).
        ``prompt_goes_on``: a prompt prefilled in chunks has more to come; lazy compaction in the
        background then commits at once, as under memory pressure: admission counts one chunk
        beside a prompt's budget, and its next chunk needs the blocks that holes hold.

        Args:
            mass: attention per physical position [B, >= L] (or the step's ``Mass`` function),
                when the policy observes it.
            unobserved: per request, its newest tokens the mass does not cover
                (``StepInput.unobserved``: a step beside the next forward takes that forward's in).
        """
        self.finish_step()  # a step begun before and not finished
        if not req_ids:
            return
        if forward_between and self.lag_start:  # deferred steps: from now on each takes in the next token too
            self.lag_start.difference_update(req_ids)
        fresh_lists, num_new = self.writes.take(req_ids)
        if self.step is None:
            start = time.perf_counter()
            self.lists.append_batch(req_ids, fresh_lists, num_new)
            self.stats.lists_seconds += time.perf_counter() - start
            return
        on_cuda = self.cache is not None and self.cache.pool.is_cuda and not self.config.synchronous_copies
        # Memory pressure: the pool could not give every running request the blocks of its next
        # decode tokens (its token and drafts: at most ceil((1 + drafts) / tokens_per_block) blocks).
        # Every one, not only this step's rows: the overlap scheduler steps an iteration's rows in
        # two calls, and the next reservation is for all of them.
        pressure = self.pool.num_free < self._next_decode_blocks() + self.config.evacuation_headroom
        self.step.start(StepInput.of_lists(req_ids, num_new, fresh_lists, mass=mass if self.needs_attention else None,
                                           unobserved=unobserved if self.needs_attention else None,
                                           pressure=pressure, commit_at_once=prompt_goes_on,
                                           stream=torch.cuda.current_stream() if on_cuda else None),
                        overlap=overlap, forward_between=forward_between)
        self._stepping = True

    def _next_decode_blocks(self) -> int:
        """Most blocks the running requests' next decode reservation takes."""
        drafts, running = self.step_drafts, self.admission.running
        if not drafts:  # no request drafts: one block each at most
            return len(running)
        tpb = self.config.tokens_per_block
        return sum(-(-(1 + drafts.get(r, 0)) // tpb) for r in running)

    def finish_step(self) -> StepOutput | None:
        """Completes the step ``start_step`` began (waits for its native call), frees the blocks
        it released; returns its output (None: no step, or native)."""
        self._land()
        out, self._finished = self._finished, None
        return out

    def _land(self) -> None:
        """The step in flight, if any, completed; its output kept for ``finish_step``."""
        if self._stepping:
            self._stepping = False
            out = self.step.finish()
            if out.num_freed:
                self._free(out.table.freed.tolist())
            if out.num_evicted:
                self.evictions.count(out.req_ids, out.victim_offsets)
            self._finished = out

    def _free(self, blocks: list[int]) -> None:
        """Blocks the step released (a keyed one stays cached)."""
        if self.prefix is not None:
            self.prefix.cache.release(blocks)
        else:
            self.pool.free(blocks)
