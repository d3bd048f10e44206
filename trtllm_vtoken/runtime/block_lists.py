# SPDX-License-Identifier: Apache-2.0
"""The ``native`` baseline's KV bookkeeping: per request its block list and its KV length, as
TensorRT-LLM's and vLLM's block managers keep them. No token table, no policy, no step: what vToken
is measured against."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockLists:
    """Block list and length per request. Logical length = physical length (nothing is evicted)."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._blocks: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    def add_request(self, req_id: int) -> None:
        if req_id in self._blocks:
            raise ValueError(f"request {req_id} is already registered")
        self._blocks[req_id], self._lengths[req_id] = [], 0

    def remove_request(self, req_id: int) -> list[int]:
        """Forgets the request; returns its block list (the caller frees it)."""
        self._lengths.pop(req_id)
        return self._blocks.pop(req_id)

    def append(self, req_id: int, new_blocks: Sequence[int], num_new: int) -> None:
        """The forward wrote ``num_new`` tokens, into ``new_blocks`` where the list was full.
        ValueError if they do not fit."""
        self.append_batch((req_id,), (new_blocks,), (num_new,))

    def append_batch(self, req_ids: Sequence[int], new_blocks: Sequence[Sequence[int]],
                     num_new: Sequence[int]) -> None:
        """``append`` for each request in order (a request that does not fit raises; the ones
        before it stay appended)."""
        blocks_of, lengths, tpb = self._blocks, self._lengths, self.tokens_per_block
        for req_id, fresh, n in zip(req_ids, new_blocks, num_new):
            blocks = blocks_of[req_id]
            if fresh:
                blocks.extend(fresh)
            length = lengths[req_id] + n
            if length > len(blocks) * tpb:
                raise ValueError(f"request {req_id}: {length} tokens do not fit {len(blocks)} blocks")
            lengths[req_id] = length

    def held(self, req_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(blocks held, KV length) of the requests, int64 arrays."""
        blocks_of, lengths = self._blocks, self._lengths
        count = len(req_ids)
        return (np.fromiter(map(len, map(blocks_of.__getitem__, req_ids)), dtype=np.int64, count=count),
                np.fromiter(map(lengths.__getitem__, req_ids), dtype=np.int64, count=count))

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._blocks

    def request_ids(self) -> list[int]:
        return list(self._blocks)

    def kv_len(self, req_id: int) -> int:
        return self._lengths[req_id]

    num_tokens = kv_len
    num_live = kv_len

    def block_ids(self, req_id: int) -> list[int]:
        return list(self._blocks[req_id])

    def num_blocks(self, req_id: int) -> int:
        return len(self._blocks[req_id])
