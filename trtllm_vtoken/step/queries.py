# SPDX-License-Identifier: Apache-2.0
"""What hosts read of a step's tables between iterations: per-request counters and block lists
(each one array read: hosts ask per request, every iteration), the batch's token layout, a
request's live ids and statistics, and a digest of the tables for comparing ranks. A base of
``DecodeStep``, reading only its batch layout (``slots``) and token-table core (``core``)."""

from __future__ import annotations

import hashlib
from collections.abc import Collection

import numpy as np

from trtllm_vtoken.step.core import TableCore
from trtllm_vtoken.step.slots import SlotMap


class TableQueries:
    """Read-only queries of a step's tables (``DecodeStep`` sets ``slots`` and ``core``)."""

    slots: SlotMap
    core: TableCore

    def settle(self) -> None:
        """Waits for a step in flight on the step's worker thread (``DecodeStep.start``): every
        query reads settled tables."""

    def kv_len(self, req_id: int) -> int:
        self.settle()
        return self.slots.kv_len.item(self.slots.row_of[req_id])

    def num_tokens(self, req_id: int) -> int:
        self.settle()
        return self.slots.num_tokens.item(self.slots.row_of[req_id])

    def num_live(self, req_id: int) -> int:
        self.settle()
        return self.slots.num_live.item(self.slots.row_of[req_id])

    def num_blocks(self, req_id: int) -> int:
        self.settle()
        return self.slots.num_blocks_of.item(self.slots.row_of[req_id])

    def counters(self, req_ids: Collection[int]) -> tuple[list[int], list[int], list[int]]:
        """(logical lengths, live tokens, blocks held) of the requests, read at once."""
        self.settle()
        rows = self.slots.rows(req_ids)
        slots = self.slots
        return slots.num_tokens[rows].tolist(), slots.num_live[rows].tolist(), slots.num_blocks_of[rows].tolist()

    def held(self, req_ids: Collection[int]) -> tuple[np.ndarray, np.ndarray]:
        """(blocks held, KV length) of the requests, int64 arrays read at once."""
        self.settle()
        rows = self.slots.rows(req_ids)
        return self.slots.num_blocks_of[rows], self.slots.kv_len[rows]

    def block_ids(self, req_id: int) -> list[int]:
        self.settle()
        row = self.slots.row_of[req_id]
        return self.slots.block_table[row, : self.slots.num_blocks_of[row]].tolist()

    def block_rows(self, req_ids: Collection[int]) -> np.ndarray:
        """[B, nb] int32: the requests' block lists, padded with ``num_blocks`` (a scratch id)."""
        self.settle()
        return self.slots.block_rows(self.slots.rows(req_ids))

    def batch_tokens(self, req_ids: Collection[int]) -> np.ndarray:
        """[B, L] int32: the live logical id at each physical position of each request, -1 where
        none (what the attention of a masked kernel may read)."""
        self.settle()
        return self.slots.gather(self.slots.tokens, self.block_rows(req_ids))

    def live_tokens(self, req_id: int) -> np.ndarray:
        """The request's live logical ids, ascending (int64)."""
        self.settle()
        return self.core.live_slots(req_id)[0]

    def token_stats(self, req_id: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(live ids ascending, the per-slot statistic ``name`` of each): what a policy has
        accumulated for the request's tokens (e.g. H2O's "mass")."""
        self.settle()
        ids, slots = self.core.live_slots(req_id)
        return ids, self.slots.stats[name][slots]

    def metadata_bytes_per_token(self) -> float:
        self.settle()
        return self.core.metadata_bytes_per_token()

    def table_digest(self, req_ids: Collection[int] | None = None) -> str:
        """SHA-256 of the requests' tables (lengths, block lists, logical id per position, liveness):
        equal on every tensor/pipeline-parallel rank when their decisions agreed."""
        self.settle()
        digest = hashlib.sha256()
        for req_id in sorted(self.request_ids() if req_ids is None else req_ids):
            seq = self.core.sequence(req_id)
            digest.update(np.array([req_id, seq.kv_len, seq.num_tokens, seq.num_live], dtype="<i8").tobytes())
            digest.update(np.asarray(seq.block_ids, dtype="<i8").tobytes())
            digest.update(seq.token_at[: seq.kv_len].astype("<i4").tobytes())
            digest.update(seq.live[: seq.num_tokens].tobytes())
        return digest.hexdigest()
