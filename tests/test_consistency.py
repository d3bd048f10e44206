# SPDX-License-Identifier: Apache-2.0
"""The rank-consistency protocol's pieces on one process: the table digest, the error that
crosses process boundaries, and the one-rank group that costs nothing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from trtllm_vtoken.consistency import RankConsistency, RankDivergenceError, SingleRank, step_digest
from trtllm_vtoken.core import TokenTable
from trtllm_vtoken.core.native import load, native_table


def table_with(make=lambda: TokenTable(4)):
    table = make()
    table.add_request(7)
    table.sync_new_tokens(7, [3, 5, 9], 10)
    table.add_request(2)
    table.sync_new_tokens(2, [1], 3)
    return table


def test_digest_is_a_pure_function_of_the_table():
    assert step_digest(table_with()) == step_digest(table_with())
    assert step_digest(table_with(), [1, 2]) == step_digest(table_with(), [1, 2])


@pytest.mark.parametrize("change", ["evict", "move", "new token", "extra", "other request"])
def test_every_decision_changes_the_digest(change):
    table = table_with()
    before = step_digest(table, [5])
    extra = [5]
    if change == "evict":
        table.evict_tokens(7, [4])
    elif change == "move":  # same liveness, another slot
        table.evict_tokens(7, [1])
        table.apply_moves(7, [9], [3 * 4 + 1])  # into the hole at block 3, offset 1
        other = table_with()
        other.evict_tokens(7, [1])
        assert step_digest(table, [5]) != step_digest(other, [5])
    elif change == "new token":
        table.sync_new_tokens(7, [3, 5, 9], 11)
    elif change == "extra":
        extra = [6]
    else:
        table.add_request(11)
    assert step_digest(table, extra) != before


@pytest.mark.skipif(load() is None, reason="the C++ token table is not built")
def test_digest_reads_the_cpp_table_as_the_python_one():
    for make in (lambda: TokenTable(4), lambda: native_table(4)):
        table = table_with(make)
        table.evict_tokens(7, [1, 4])
        table.apply_moves(7, [9], [3 * 4 + 1])
        if make().__class__ is TokenTable:
            python = step_digest(table, [3])
        else:
            assert step_digest(table, [3]) == python


def test_divergence_error_names_the_step_and_ranks_and_pickles_whole():
    error = RankDivergenceError(4, [11, 11, -3])
    assert "step 4" in str(error) and "ranks [0, 1]" in str(error) and "ranks [2]" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert (again.step, again.digests, str(again)) == (4, [11, 11, -3], str(error))


def test_one_rank_reduces_nothing_and_checks_nothing():
    protocol = RankConsistency(SingleRank())
    mass = torch.arange(6.0).view(2, 3)
    assert protocol.reduce_mass(mass) is mass and protocol.reduce_mass(None) is None
    protocol.check(0, table_with())
    assert (protocol.stats.reductions, protocol.stats.checks) == (0, 0)


class ScaledRanks(SingleRank):
    """A group whose 'other ranks' hold the same mass: the sum is world_size times one's own."""

    world_size = 3

    def all_reduce_sum(self, tensor):
        return tensor.mul_(self.world_size)

    def all_gather_int(self, value):
        return [value] * self.world_size


def test_the_protocol_counts_what_it_reduces():
    protocol = RankConsistency(ScaledRanks())
    out = protocol.reduce_mass(torch.ones(2, 5))
    assert torch.equal(out, torch.full((2, 5), 3.0))
    assert (protocol.stats.reductions, protocol.stats.bytes_reduced) == (1, 40)
    protocol.check(0, table_with())
    assert protocol.stats.checks == 1
    off = RankConsistency(ScaledRanks(), reduce_mass=False)
    assert torch.equal(off.reduce_mass(torch.ones(2)), torch.ones(2)) and off.stats.reductions == 0


def test_numpy_mass_and_hex_digests():
    """The one batched step hands the mass as a numpy array and its digest as SHA-256 hex."""
    protocol = RankConsistency(ScaledRanks())
    out = protocol.reduce_mass(np.ones((2, 3), dtype=np.float32))
    assert isinstance(out, np.ndarray) and (out == 3).all() and protocol.stats.bytes_reduced == 24
    protocol.check_digest(1, "ab" * 32)
    assert protocol.stats.checks == 1


def test_a_carried_mass_is_counted_not_reduced_again():
    class AttachingRanks(ScaledRanks):
        def attach(self, tensor):
            self.attached = tensor

    ranks = AttachingRanks()
    protocol = RankConsistency(ranks)
    mass = torch.ones(2, 4)
    protocol.carry(mass)  # the forward's last all-reduce sums it (not here)
    assert ranks.attached is mass
    assert protocol.reduce_mass(mass) is mass and torch.equal(mass, torch.ones(2, 4))
    assert (protocol.stats.reductions, protocol.stats.carried, protocol.stats.bytes_reduced) == (1, 1, 32)
    assert RankConsistency(ScaledRanks()).carry is None  # a group that cannot carry reduces on its own
    assert RankConsistency(AttachingRanks(), reduce_mass=False).carry is None


def test_numpy_free_digest_inputs():
    """Block lists given as plain lists and arrays hash alike (the C++ table returns lists)."""
    assert step_digest(table_with(), np.array([5])) == step_digest(table_with(), [5])
