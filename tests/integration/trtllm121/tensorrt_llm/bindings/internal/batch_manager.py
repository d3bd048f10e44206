# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm.bindings.internal.batch_manager.KVCacheManager``: the C++
``KVCacheManager`` and its ``BlockManager`` (``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``,
1.2-era copies, index ids 2600970701, 36939959573, 126178160; ``evictionPolicy.cpp`` 781321096),
which the Python ``KVCacheManager`` holds as ``impl`` and the capacity scheduler reads directly.

Imitated, per behaviour:
- Sequences by request id (``mSequences``); ``getSequence`` is ``mSequences.at(id)``, whose
  ``std::out_of_range`` the bindings raise as ``IndexError`` (``PyExecutor._do_terminate_request``
  catches ``IndexError`` around ``get_cache_indices`` for exactly this). So ``add_token``,
  ``rewind_kv_cache`` and ``get_cache_block_ids`` of a removed request raise ``IndexError``;
  ``remove_sequence`` of one is a no-op (``mSequences.extract``); ``store_context_blocks`` of one
  logs "storeContextBlocks: Can not find sequence for request N" and returns.
- ``add_sequence`` twice for one id: ``TLLM_CHECK(emplaceDone)``, a RuntimeError.
- ``updateToken``: a block is allocated when the length crosses a block boundary, taken from the
  FRONT of the free queue (``LRUEvictionPolicy::getFreeBlock``); none left: ``TLLM_THROW("No free
  block found. This shouldn't happen!")``, a RuntimeError. Removing a token across a boundary
  releases the last block to the FRONT (``releaseLastBlock`` -> ``releaseBlock(block, true)``);
  ``removeSequence`` releases every block to the END. ``removeToken`` of an empty sequence returns.
- Scheduling (``startScheduling``, ``schedulingRemoveSequence``, ``schedulingHasFreeBlocks``):
  the capacity scheduler's own count of free blocks, in which a paused request's blocks are free.
- ``getRemainingBlocksToCompletion(req)`` (GUARANTEED_NO_EVICT): the blocks of ``mPromptLen +
  mMaxNewTokens`` minus those the sequence holds.
- ``getNeededBlocksOneStep(req, twoStepsLookAhead)``: a first context chunk needs its prompt's
  blocks; a generation request needs a block when its LOGICAL length (``mPromptLen`` + generated
  tokens) crosses a boundary in the next step (or two), a step adding the token and its draft
  tokens (at most the tokens it may still add); other states need none.
- Block reuse (``enable_block_reuse``): full blocks enter the reuse tree keyed by the token chain
  up to their end: ``storeContextBlocks`` for the first ``len(tokens) - 1`` tokens (full blocks
  only); ``removeSequence`` with a request (``releaseBlocks(seq, llmRequest)``) every block of the
  first ``len(tokens) - 1`` tokens, the partial last one too; with ``None`` nothing is stored.
  ``addSequence`` recovers the longest chain of stored full blocks over the first
  ``prompt_len - 1`` tokens (a reference per holder; a stored block nobody holds is taken back
  out of the free queue) and sets the request's prepopulated length
  (``context_current_position``); a block taken from the free queue for new content leaves the
  tree.
- Partial reuse (``enable_partial_reuse``, TensorRT-LLM's default; ``WindowBlockManager::
  loadOrAllocateBlocks`` and ``KVCacheBlock::findMatchingBlock``, 1.2-era copy index id
  1277673704): where the chain of full blocks ends, a stored block that continues it and shares
  the prompt's next tokens (or equals them, if stored partly filled) matches those tokens: the
  best among the children that are free leaves (any child with ``copy_on_partial_reuse``). A
  block someone holds or that has children is copied (``getFreeBlock``, then the transfer
  manager's ``onboard`` of the matched tokens' KV, the ``onboard`` callback here); a free leaf is
  taken over (``claimLeafBlock``: out of the free queue and out of the tree) and the request
  writes its own tokens after the matched ones. Matching stops there; the prepopulated length may
  end inside a block (``setPrepopulatedPromptLen``).
Beam width 1 only (vToken's requirement; ``removeToken`` checks it too). Bound without argument
names, so positional only (nanobind ``.def("remove_sequence", &BaseKVCacheManager::removeSequence)``,
index id 585945368); ``llm_request`` is an ``OptionalRef`` that takes ``None`` (index id 1039870972).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("tensorrt_llm")


@dataclass
class KvCacheStats:
    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int


class KVCacheManager:
    def __init__(self, *, tokens_per_block: int, blocks_in_primary_pool: int, enable_block_reuse: bool,
                 max_sequence_length: int, enable_partial_reuse: bool = False, copy_on_partial_reuse: bool = True,
                 onboard=None) -> None:
        self.tokens_per_block = tokens_per_block
        self.enable_partial_reuse, self.copy_on_partial_reuse = enable_partial_reuse, copy_on_partial_reuse
        self._onboard = onboard  # (source block, new block, tokens): copies their KV (the pools' owner)
        self.partial_hits = {"copied": 0, "taken over": 0}  # test view
        self.max_num_blocks = blocks_in_primary_pool
        self.enable_block_reuse = enable_block_reuse
        self.max_token_num = max_sequence_length
        self._free = deque(range(blocks_in_primary_pool))
        self._refs = [0] * blocks_in_primary_pool
        self._blocks: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        self._tree: dict[tuple, int] = {}  # token ids up to a block's end -> the block holding their KV
        self._key_of: dict[int, tuple] = {}
        self._scheduling_free = 0
        self._scheduling_refs: list[int] = []

    # ---- sequences ------------------------------------------------------------------------------
    def _sequence(self, request_id: int) -> list[int]:
        try:
            return self._blocks[request_id]
        except KeyError:
            raise IndexError(f"unordered_map::at: request {request_id} has no sequence") from None

    def add_sequence(self, request_id: int, input_length: int, beam_width: int, llm_request=None, /) -> None:
        if beam_width != 1:
            raise NotImplementedError("this double models beam width 1 (vToken's requirement)")
        if request_id in self._blocks:
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: emplaceDone (sequence {request_id} exists)")
        self._blocks[request_id], self._num_tokens[request_id] = [], 0
        if self.enable_block_reuse and llm_request is not None:
            self._load_blocks(request_id, llm_request.get_tokens(0), input_length - 1)  # the last token: never
            if self._num_tokens[request_id]:
                llm_request.set_prepopulated_prompt_len(self._num_tokens[request_id], self.tokens_per_block)
        for _ in range(input_length - self._num_tokens[request_id]):
            self._update_token(request_id, add=True)

    def _load_blocks(self, request_id: int, tokens: list[int], usable: int) -> None:
        """``loadOrAllocateBlocks``: the stored chain of full blocks over the first ``usable``
        tokens, then at most one partly matching block (partial reuse)."""
        tpb, sequence = self.tokens_per_block, self._blocks[request_id]
        for start in range(0, usable, tpb):
            end = min(start + tpb, usable)
            block = self._tree.get(tuple(tokens[:end]))
            if block is not None and end - start == tpb:  # a full block: shared
                self._hold(block)
                sequence.append(block)
                self._num_tokens[request_id] = end
                continue
            matched = (block, end - start) if block is not None else self._partial_match(tokens, start, end)
            if matched is None:
                return
            block, count = matched
            if self._refs[block] or not self._is_leaf(self._key_of[block]):  # in use: its tokens copied
                new = self._take_free_block()
                if self._onboard is not None:
                    self._onboard(block, new, count)
                block = new
                self.partial_hits["copied"] += 1
            else:  # a free leaf: taken over, out of the tree
                del self._tree[self._key_of.pop(block)]
                self._hold(block)
                self.partial_hits["taken over"] += 1
            sequence.append(block)
            self._num_tokens[request_id] = start + count
            return

    def _partial_match(self, tokens: list[int], start: int, end: int) -> tuple[int, int] | None:
        """``findMatchingBlock`` with partial reuse: the stored child of the chain ``tokens[:start]``
        sharing the most leading tokens with ``tokens[start:end]`` (the first such on a tie)."""
        if not self.enable_partial_reuse:
            return None
        best, best_count, prefix = None, 0, tuple(tokens[:start])
        for key, block in self._tree.items():
            if not start < len(key) <= start + self.tokens_per_block or key[:start] != prefix:
                continue
            if not (self.copy_on_partial_reuse or (self._refs[block] == 0 and self._is_leaf(key))):
                continue
            count = 0
            while start + count < min(len(key), end) and key[start + count] == tokens[start + count]:
                count += 1
            if count > best_count:
                best, best_count = block, count
        return (best, best_count) if best is not None else None

    def _is_leaf(self, key: tuple) -> bool:
        return not any(len(other) > len(key) and other[: len(key)] == key for other in self._tree)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._free.remove(block)
        self._refs[block] += 1

    def add_token(self, request_id: int, /) -> None:
        self._sequence(request_id)
        self._update_token(request_id, add=True)

    def rewind_kv_cache(self, request_id: int, rewind_length: int, /) -> None:
        self._sequence(request_id)
        for _ in range(rewind_length):
            if self._num_tokens[request_id] == 0:
                continue
            self._update_token(request_id, add=False)

    def _update_token(self, request_id: int, add: bool) -> None:
        tpb = self.tokens_per_block
        if add:
            if self._num_tokens[request_id] % tpb == 0:
                self._blocks[request_id].append(self._take_free_block())
            self._num_tokens[request_id] += 1
            return
        self._num_tokens[request_id] -= 1
        if self._num_tokens[request_id] % tpb == 0:
            block = self._blocks[request_id].pop()
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.appendleft(block)

    def _take_free_block(self) -> int:
        if not self._free:
            raise RuntimeError("[TensorRT-LLM][ERROR] No free block found. This shouldn't happen!")
        block = self._free.popleft()
        key = self._key_of.pop(block, None)  # new content: the block leaves the reuse tree
        if key is not None:
            del self._tree[key]
        self._refs[block] += 1
        return block

    def remove_sequence(self, request_id: int, llm_request=None, pin_on_release: bool = False, /) -> None:
        if request_id not in self._blocks:
            return
        if self.enable_block_reuse and llm_request is not None and not llm_request.is_dummy_request:
            tokens = llm_request.get_tokens(0)
            self._store(request_id, tokens, len(tokens) - 1, allow_partial=True)
        for block in reversed(self._blocks.pop(request_id)):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        del self._num_tokens[request_id]

    def store_context_blocks(self, llm_request, /) -> None:
        request_id = llm_request.py_request_id
        if request_id not in self._blocks:
            log.warning("[kv cache manager] storeContextBlocks: Can not find sequence for request %d", request_id)
            return
        if self.enable_block_reuse:
            tokens = llm_request.get_tokens(0)
            self._store(request_id, tokens, len(tokens) - 1, allow_partial=False)

    def _store(self, request_id: int, tokens: list[int], usable: int, allow_partial: bool) -> None:
        """``storeBlocks``: the request's blocks over its first ``usable`` tokens enter the tree
        under the token chain up to each block's end (a key already stored keeps its block)."""
        tpb = self.tokens_per_block
        ends = list(range(tpb, usable + 1, tpb)) + ([usable] if allow_partial and usable % tpb else [])
        for block, end in zip(self._blocks[request_id], ends):
            key = tuple(tokens[:end])
            if key not in self._tree and block not in self._key_of:
                self._tree[key], self._key_of[block] = block, key

    # ---- reads --------------------------------------------------------------------------------
    def get_cache_block_ids(self, request_id: int, window_size=None, /) -> list[list[int]]:
        return [list(self._sequence(request_id))]

    def get_batch_cache_block_ids(self, request_ids, window_size=None, /) -> list[list[list[int]]]:
        return [self.get_cache_block_ids(r) for r in request_ids]

    def get_kv_cache_stats(self) -> KvCacheStats:
        free = len(self._free)
        return KvCacheStats(self.max_num_blocks, free, self.max_num_blocks - free, self.tokens_per_block)

    def refresh_blocks(self) -> None:
        return None  # no secondary pool, nothing to onboard

    def sync_transfer_manager_with_buffer_manager(self) -> None:
        return None

    # ---- the capacity scheduler's view -----------------------------------------------------------
    def start_scheduling(self) -> None:
        self._scheduling_free = len(self._free)
        self._scheduling_refs = list(self._refs)

    def scheduling_remove_sequence(self, request_id: int) -> None:
        for block in self._blocks.get(request_id, []):
            self._scheduling_refs[block] -= 1
            if self._scheduling_refs[block] == 0:
                self._scheduling_free += 1

    def scheduling_has_free_blocks(self, num_required: int) -> bool:
        return num_required <= self._scheduling_free

    def get_needed_blocks_one_step(self, req, two_steps_look_ahead: bool) -> int:
        tpb = self.tokens_per_block
        if req.is_context_init_state() and req.is_first_context_chunk:
            return -(-req.prompt_len // tpb)
        if req.is_generation_in_progress_state():
            generated = req.max_num_generated_tokens
            steps_left = req.max_new_tokens - generated + 1
            per_step = min(len(req.py_draft_tokens) + 1, steps_left)  # the token and its drafts
            past = req.prompt_len + generated - 1
            after = past + (2 if two_steps_look_ahead else 1) * per_step
            if after > self.max_token_num:
                return 0
            return -(-after // tpb) - -(-past // tpb)
        return 0

    def get_remaining_blocks_to_completion(self, req) -> int:
        """``getRemainingBlocksToCompletion``: blocks of ``mPromptLen + mMaxNewTokens`` not held yet."""
        tpb = self.tokens_per_block
        total = -(-(req.prompt_len + req.max_new_tokens) // tpb)
        held = len(self._blocks.get(req.py_request_id, []))
        context = req.prompt_len // tpb
        if held < context:
            return context - held + (total - context)
        return total - held

    # ---- test views ---------------------------------------------------------------------------
    def stored_blocks(self) -> dict[tuple, int]:
        """The reuse tree: token chain -> block."""
        return dict(self._tree)

    def num_tokens(self, request_id: int) -> int:
        """``GenerationRequest::getNumTokens``."""
        return self._num_tokens[request_id]

    def sequence_ids(self) -> list[int]:
        return sorted(self._blocks)
