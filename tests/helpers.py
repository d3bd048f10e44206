# SPDX-License-Identifier: Apache-2.0
"""Small factories shared by the tests."""

from __future__ import annotations

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.reclaim.dead_blocks import fully_dead_blocks
from trtllm_vtoken.reclaim.planner import commit_plan, plan_for_mode


def make_table(num_blocks: int = 16, tokens_per_block: int = 4) -> tuple[BlockPool, TokenTable]:
    pool = BlockPool(num_blocks, tokens_per_block)
    return pool, TokenTable(tokens_per_block, pool.is_shared)


def add_sequence(pool: BlockPool, table: TokenTable, req_id: int, num_tokens: int) -> list[int]:
    """Registers a request holding ``num_tokens`` tokens in freshly allocated blocks."""
    table.add_request(req_id)
    blocks = pool.allocate(-(-num_tokens // pool.tokens_per_block))
    assert blocks is not None
    table.sync_new_tokens(req_id, blocks, num_tokens)
    return blocks


def make_kv(pool: BlockPool, num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8,
            seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random KV pool [num_blocks, layers, 2, heads, tokens_per_block, head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (pool.num_blocks, num_layers, 2, num_kv_heads, pool.tokens_per_block, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def make_backend(pool: BlockPool, table: TokenTable, kv: torch.Tensor | None = None,
                 mode: str = "dense", threshold: int = 1) -> ReclaimBackend:
    executor = TorchCopyExecutor([kv]) if kv is not None else None
    config = ReclaimConfig(mode=mode, fragmentation_threshold=threshold, check_invariants=True)
    return ReclaimBackend(table, pool, executor, config)


def table_fingerprint(table: TokenTable) -> tuple:
    """Everything observable about the table, to assert that a failed call changed nothing."""
    out = []
    for r in sorted(table.request_ids()):
        s = table.seq(r)
        out.append((r, tuple(s.block_ids), s.kv_len, s.num_tokens, s.num_live, s.version,
                    s.slot_of[: s.num_tokens].tobytes(), s.live[: s.num_tokens].tobytes(),
                    s.token_at.tobytes(), s.live_per_block.tobytes()))
    return tuple(out)


def kv_of(table: TokenTable, kv: torch.Tensor, req_id: int, token_id: int) -> torch.Tensor:
    block, offset = table.lookup(req_id, token_id)
    return kv[block, :, :, :, offset].clone()


def ideal_blocks(num_live: int, tokens_per_block: int) -> int:
    return int(np.ceil(num_live / tokens_per_block))


def py_commit(table: TokenTable, plan) -> list[int]:
    """What ReclaimBackend does at commit, without a copy: the C++ ``commit``'s specification."""
    return commit_plan(table, plan)


def step_loop(table: TokenTable, step: dict, mode: str, threshold: int, pressure: bool) -> tuple[list, list]:
    """The per-request loop ``step_batch`` is specified by: (moves per request as (token, source
    slot, destination slot) lists, freed blocks per request)."""
    moves, freed = [], []
    for req, added, n, victims in zip(step["req_ids"], step["new_blocks"], step["num_new"], step["evictions"]):
        table.sync_new_tokens(req, table.block_ids(req) + added, table.kv_len(req) + n)
        table.evict_tokens(req, victims)
        if mode == "dead-blocks":
            dead = fully_dead_blocks(table, req)
            table.release_blocks(req, dead)
            moves.append([])
            freed.append(dead)
            continue
        plan = plan_for_mode(table, req, "lazy" if mode == "lazy-deferred" else mode, threshold, pressure)
        moves.append(list(zip(plan.token_ids, plan.src_slots, plan.dst_slots)) if plan else [])
        if mode == "lazy-deferred":  # planned, not committed
            freed.append(list(plan.blocks_to_free) if plan else [])
        else:
            freed.append(py_commit(table, plan) if plan else [])
    return moves, freed


def result_lists(result) -> tuple[list, list]:
    """A ``StepBatchResult`` as ``step_loop``'s (moves per request, freed per request)."""
    batch = len(result.kv_lens)
    return [result.moves_of(i) for i in range(batch)], [result.freed_of(i) for i in range(batch)]


def random_step(rng: np.random.Generator, table: TokenTable, next_block: int) -> tuple[dict, int]:
    """A valid random decode step for every request of ``table`` (any order): 0-2 new tokens,
    sometimes a spare block, 0-2 evictions among the unprotected live tokens (the newest
    included). Returns the step (lists, and ``csr``: step_batch's arguments) and the next free
    block id."""
    tpb = table.tokens_per_block
    step = {"req_ids": rng.permutation(table.request_ids()).tolist(), "new_blocks": [], "num_new": [],
            "evictions": []}
    for req in step["req_ids"]:
        n = int(rng.integers(0, 3))
        need = max(-(-(table.kv_len(req) + n) // tpb) - table.num_blocks(req), 0) + int(rng.random() < 0.1)
        step["new_blocks"].append(list(range(next_block, next_block + need)))
        next_block += need
        step["num_new"].append(n)
        live = np.setdiff1d(table.live_ids(req), table.protected_ids(req)).tolist()
        blocks, kv_len = table.block_ids(req) + step["new_blocks"][-1], table.kv_len(req)
        live += [table.num_tokens(req) + j for j in range(n)  # this step's tokens
                 if not table.is_shared(blocks[(kv_len + j) // tpb])]
        k = min(len(live), int(rng.integers(0, 3)))
        step["evictions"].append(rng.choice(live, size=k, replace=False).tolist() if k else [])

    block_offsets, blocks = as_csr(step["new_blocks"])
    evict_offsets, evicts = as_csr(step["evictions"])
    step["csr"] = (np.array(step["req_ids"], dtype=np.int64), np.array(step["num_new"], dtype=np.int64),
                   block_offsets, blocks, evict_offsets, evicts)
    return step, next_block


def as_csr(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """step_batch's form of per-request lists: (offsets [len(rows) + 1], values), int64."""
    offsets = np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)
    return offsets, np.array([v for row in rows for v in row], dtype=np.int64)
