# SPDX-License-Identifier: Apache-2.0
"""Identical eviction decisions on every tensor- and pipeline-parallel rank.

Under tensor parallelism (TP) each rank holds the KV of its own attention heads; under pipeline
parallelism (PP) the KV of its own layers. Every rank runs the same block allocator and token table
over its share of the pool, so every rank must take the same decision at every step -- same
victims, same plans, same freed blocks -- or the block tables diverge and KV is silently
corrupted. Two things make it so.

1. **Every input of a decision is the same on every rank.** Policies see logical ids, positions,
   a budget and, for Random, a generator seeded per request (never per process). The one input
   that depends on the rank is the attention mass: a rank computes it from its own heads and
   layers only. The protocol sums it over all ranks before any policy scores:

        rank 0:  mass[B, L] from query heads 0-5 (KV heads 0-1), its layers  --+
        rank 1:  mass[B, L] from query heads 6-8 (KV head 2),    its layers  --+-- sum over ranks
                                                                                 |
        every rank: mass[B, L] of all heads and layers = what one GPU sees  <---+

   Where the forward itself produces the mass (the reference runtime), the mass is complete after
   the last layer's attention, just before that layer's o_proj all-reduce, and **rides in it**
   (``carry``: one buffer, one collective): the protocol costs bytes, not a collective. Where the
   mass is computed after the forward (TensorRT-LLM: from recorded queries), it is one all-reduce
   of its own per step. Either way the sum must come back bit-identical on every rank (an
   all-reduce that reduces each element once and hands the result to all, as ring and tree
   all-reduce do); the digest check below proves it at run time.

   The alternative, "decide on one rank and broadcast the victims", still needs the whole mass on
   that rank (a reduce of the same bytes), then one more collective for the victims, which exist
   only after the policy ran -- after the forward, so they can ride in nothing -- while the other
   ranks wait for that rank's policy. ``vtoken bench tp`` times both on the same shapes
   (benchmarks/RESULTS.md).

2. **A check that fails loudly** (with ``check_invariants``): after each step every rank hashes its
   token table, its free-block count and the tokens it sampled (``step_digest``); the digests are
   all-gathered and compared. A difference raises ``RankDivergenceError`` on every rank in the
   same step, so no rank runs on alone into a collective the others never join.

Policies that observe no attention (StreamingLLM, sliding window, Random) need no communication
at all: their inputs are rank-independent by construction.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class RankDivergenceError(RuntimeError):
    """Ranks disagree on the token table: their KV would be silently corrupted from here on."""

    def __init__(self, step: int, digests: list[int]) -> None:
        groups: dict[int, list[int]] = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        listed = "; ".join(f"ranks {ranks}: {digest & (2**64 - 1):016x}" for digest, ranks in groups.items())
        super().__init__(f"token tables diverged across ranks at step {step} ({listed})")
        self.step = step
        self.digests = digests

    def __reduce__(self):  # crosses process boundaries whole (rank processes report it)
        return type(self), (self.step, self.digests)


class RankGroup(ABC):
    """The ranks that hold one model instance (all of its TP and PP ranks) and the two collectives
    the protocol needs. Every rank must call each collective in the same order."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over all ranks, in place; the result is bit-identical on every rank.
        Returns it."""

    @abstractmethod
    def all_gather_int(self, value: int) -> list[int]:
        """Every rank's signed 64-bit ``value``, in rank order."""

    # Optional: ``attach(tensor)`` -- sum ``tensor`` in place within the next ``all_reduce_sum``
    # (one buffer, one collective). Groups whose collectives run inside the forward offer it.


class SingleRank(RankGroup):
    """One process holds the whole model: nothing to reduce, nothing to compare."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_int(self, value: int) -> list[int]:
        return [value]


@dataclass
class ProtocolStats:
    reductions: int = 0
    """Reductions of attention mass (one per forward that needs it)."""
    carried: int = 0
    """Of those, the ones that rode in the forward's last all-reduce (no collective of their own)."""
    bytes_reduced: int = 0
    """Bytes of mass each rank contributed, summed over reductions."""
    reduce_seconds: float = 0.0
    """Wall time inside the mass all-reduce (including waiting for the slowest rank)."""
    checks: int = 0
    check_seconds: float = 0.0
    """Wall time of the digest checks' all-gathers, ``check_invariants`` only."""
    durations: list[float] | None = None
    """Seconds of each reduction, if a list is given (benchmarks)."""


class RankConsistency:
    """The protocol for one engine on one rank.

    Args:
        ranks: this model instance's ranks.
        reduce_mass: False turns the reduction off: each rank then scores from its own heads and
            layers only -- the baseline that measures the protocol's cost and shows what it
            prevents (the digest check catches the divergence).
    """

    def __init__(self, ranks: RankGroup, reduce_mass: bool = True) -> None:
        self.ranks = ranks
        self.reduce = reduce_mass and ranks.world_size > 1
        self.stats = ProtocolStats()
        self._carried: Any = None
        attach = getattr(ranks, "attach", None)
        self.carry = self._carry if self.reduce and attach is not None else None
        """Where the forward produces the mass and the group can: hand it over before the last
        all-reduce of the forward, which sums it in the same collective (``RankGroup.attach``);
        None otherwise."""

    def _carry(self, mass: torch.Tensor) -> None:
        self.ranks.attach(mass)
        self._carried = mass

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    def reduce_mass(self, mass):
        """The batch's attention mass [B, L] summed over every rank's heads and layers: a torch
        tensor (reduced in place, on its device) or a numpy array (a new one). None passes."""
        if mass is None or not self.reduce:
            return mass
        if mass is self._carried:  # summed already, by the forward's last all-reduce
            self._carried = None
            self.stats.reductions += 1
            self.stats.carried += 1
            self.stats.bytes_reduced += mass.numel() * mass.element_size()
            return mass
        start = time.perf_counter()
        if isinstance(mass, np.ndarray):
            mass = self.ranks.all_reduce_sum(torch.from_numpy(np.ascontiguousarray(mass))).numpy()
            nbytes = mass.nbytes
        else:
            mass = self.ranks.all_reduce_sum(mass.contiguous())
            nbytes = mass.numel() * mass.element_size()
        elapsed = time.perf_counter() - start
        self.stats.reduce_seconds += elapsed
        self.stats.reductions += 1
        self.stats.bytes_reduced += nbytes
        if self.stats.durations is not None:
            self.stats.durations.append(elapsed)
        return mass

    def check(self, step: int, table: Any, extra: Iterable[int] = ()) -> None:
        """Compares ``step_digest(table, extra)`` across ranks (see ``check_digest``)."""
        if self.ranks.world_size > 1:
            self.check_digest(step, step_digest(table, extra))

    def check_digest(self, step: int, digest: int | str) -> None:
        """Compares this rank's digest of its state after ``step`` with every other rank's;
        RankDivergenceError on any difference, raised on every rank. A hex string (a SHA digest)
        is compared by its first 64 bits. A no-op on one rank."""
        if self.ranks.world_size == 1:
            return
        if isinstance(digest, str):
            digest = int.from_bytes(bytes.fromhex(digest[:16]), "little", signed=True)
        start = time.perf_counter()
        digests = self.ranks.all_gather_int(digest)
        self.stats.check_seconds += time.perf_counter() - start
        self.stats.checks += 1
        if len(set(digests)) != 1:
            raise RankDivergenceError(step, digests)


def step_digest(table: Any, extra: Iterable[int] = ()) -> int:
    """A signed 64-bit hash of everything a decision changes in a token table: per request (by
    id), its block list, lengths, live bits and the slot of every token; plus ``extra`` integers
    (free blocks, sampled tokens). Works on the Python table, the C++ one (``state``), a
    ``DecodeStep`` (``table_digest``) and native's block lists.
    Independent of the process (no ``hash()``), so equal tables give equal digests on any rank."""
    h = hashlib.blake2b(digest_size=8)
    if hasattr(table, "table_digest"):  # a DecodeStep: the SHA-256 of its tables
        h.update(table.table_digest().encode())
    else:
        for req_id in sorted(table.request_ids()):
            h.update(_request_digest_bytes(table, req_id))
    h.update(np.array(list(extra), dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def _request_digest_bytes(table: Any, req_id: int) -> bytes:
    """One request of a token table (Python, or C++ through ``state``) or of native's block
    lists: its lengths, block list and, for a token table, the live bit and slot of every token."""
    if hasattr(table, "state"):  # the C++ table exposes its arrays as one tuple
        block_ids, kv_len, num_tokens, num_live, _, slot_of, live, *_ = table.state(req_id)
    elif hasattr(table, "seq"):
        seq = table.seq(req_id)
        block_ids, kv_len, num_tokens, num_live = seq.block_ids, seq.kv_len, seq.num_tokens, seq.num_live
        slot_of, live = seq.slot_of, seq.live
    else:  # plain block lists: every token live, in order (nothing per token to compare)
        block_ids, kv_len = table.block_ids(req_id), table.kv_len(req_id)
        return np.array([req_id, kv_len, kv_len, kv_len, len(block_ids), *block_ids], dtype=np.int64).tobytes()
    head = np.array([req_id, kv_len, num_tokens, num_live, len(block_ids), *block_ids], dtype=np.int64)
    return head.tobytes() + np.asarray(live[:num_tokens], dtype=np.uint8).tobytes() + \
        np.asarray(slot_of[:num_tokens], dtype=np.int64).tobytes()
