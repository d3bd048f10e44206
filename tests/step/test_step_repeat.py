# SPDX-License-Identifier: Apache-2.0
"""A decode loop passes the same lists step after step: the call on the worker then repeats the
last one's arguments with no check or decision in Python (``step/fused.py`` ``RepeatedCall``).
Held to the whole path (the call at once, ``overlap=False``) step by step, with and without a
victims hook (prefix caching's cut, run after the repeated call), through what must end
the repetition: a request joining or leaving, a new budget, a block table outgrowing its
columns, a block becoming shared, a list read anew, a bad block id. H2O repeats where the host
hands the same mass buffer every step, rewritten in place, or a new array of its rows and dtype
each step, and not where it hands another dtype, a tensor, or the step reduces the mass across
ranks; a mass too narrow for the rows refuses the call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.step.drive import Host, make_step
from tests.step.test_step_parity import outputs_equal, tables_equal
from trtllm_vtoken.core.native import load
from trtllm_vtoken.policies import Budget, make_policy
from trtllm_vtoken.step import StepInput

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")


def decode_loop(overlap: bool, steps: int = 60, hooked: list | None = None):
    """Four requests decoding with the same lists, and what breaks the repetition on the way;
    returns the outputs, the step and how many steps repeated. ``hooked``: a victims hook (as
    prefix caching's cut) appends what it sees there: the victims and each evicting request's
    block list as the decision saw it."""
    host = Host(96, 4)
    policy = make_policy("streaming_llm", 12, n_sink=2)

    def hook(req_ids, offsets, victims, block_ids):
        evicting = [int(r) for i, r in enumerate(req_ids) if offsets[i + 1] > offsets[i]]
        hooked.append((req_ids.tolist(), victims.tolist(), [block_ids(r) for r in evicting]))

    step = make_step(host, "cpp", "dense", policy=policy, checks=False, on_victims=None if hooked is None else hook)
    req_ids, num_new = [0, 1, 2, 3], [1, 1, 1, 1]
    for req in req_ids:
        step.add_request(req)
    outs = [step.run(StepInput.of_lists(req_ids, [5, 6, 7, 8], [host.allocate(2) for _ in req_ids]))]
    for i in range(steps):
        if i == 15:
            policy.budget = Budget(tokens=9)  # a new rule: the decision is made again
        if i == 25:  # a request leaves and another joins: other rows
            host.release(step.remove_request(3))
            step.add_request(9)
            req_ids, num_new = [0, 1, 2, 9], [1, 1, 1, 4]
        if i == 26:
            num_new = [1, 1, 1, 1]
        if i == 35 and step.kv_len(0) >= host.tpb:
            host.shared.add(step.block_ids(0)[0])  # prefix caching shares a block: skip_shared
        if i == 45:
            with pytest.raises(ValueError, match="new block ids must lie in"):
                step.start(StepInput.of_lists(req_ids, num_new, [[999], [], [], []]), overlap=overlap)
        fresh = [host.allocate(1) if step.kv_len(r) + n > step.num_blocks(r) * host.tpb else []
                 for r, n in zip(req_ids, num_new)]
        if i == 50:  # the rows' lists outgrow the block table
            fresh[1] += host.allocate(40)
        step.start(StepInput.of_lists(req_ids, num_new, fresh), overlap=overlap)
        out = step.finish()
        host.release(out.table.freed.tolist())
        outs.append(out)
    return outs, step, step.stats.repeated_steps


@pytest.mark.parametrize("with_hook", [False, True])
def test_repeated_calls_equal_the_whole_path(with_hook):
    hooked = {True: [], False: []} if with_hook else {True: None, False: None}
    repeated, step, times = decode_loop(overlap=True, hooked=hooked[True])
    whole, reference, never = decode_loop(overlap=False, hooked=hooked[False])
    if with_hook:  # the hook sees the same, after the repeated call as inside the call at once
        assert len(hooked[True]) > 40 and hooked[True] == hooked[False]
    # Every step of the loop repeats but the first and those after each change: a new rule, new
    # rows, new token counts, a shared block, a block table too narrow (the refused batch changes
    # nothing: the next step repeats).
    assert never == 0 and times == len(repeated) - 1 - 6
    for a, b in zip(repeated, whole):
        outputs_equal(a, b)
        assert not a.req_ids.flags.writeable
    tables_equal(step, reference)
    assert step.stats.overlapped_steps == len(repeated) - 1


def test_a_list_changed_in_place_is_read_anew():
    """The step keeps copies of the host's lists: a list the host changes in place no longer
    matches, and the whole path reads it."""
    host = Host(32, 4)
    step = make_step(host, "cpp", "dense", policy=make_policy("streaming_llm", 6, n_sink=2), checks=False)
    req_ids, num_new = [0, 1], [4, 4]
    for req in req_ids:
        step.add_request(req)
    for _ in range(3):
        fresh = [host.allocate(1) if step.kv_len(r) + n > step.num_blocks(r) * host.tpb else []
                 for r, n in zip(req_ids, num_new)]
        step.start(StepInput.of_lists(req_ids, num_new, fresh), overlap=True)
        step.finish()
        num_new[:] = [1, 1]
    assert step.stats.repeated_steps == 1 and step.num_tokens(0) == 6
    req_ids.reverse()  # the same requests, other order: read anew
    step.start(StepInput.of_lists(req_ids, num_new, [[], []]), overlap=True)
    out = step.finish()
    assert out.req_ids.tolist() == [1, 0] and step.stats.repeated_steps == 1
    assert np.array_equal(out.num_tokens, [7, 7])


def h2o_loop(overlap: bool, mass_of, steps: int = 30, budget: int = 12, reduce_mass=None):
    """Three requests decoding under H2O, the attention mass of each step from ``mass_of(i,
    values)`` (``values``: the step's random [3, 40] float32 mass); returns the outputs, the step
    and the host (its KV pool, its free blocks)."""
    host = Host(96, 4)
    step = make_step(host, "cpp", "dense", policy=make_policy("h2o", budget), checks=False, reduce_mass=reduce_mass)
    rng = np.random.default_rng(5)
    req_ids, num_new = [0, 1, 2], [5, 6, 7]
    for req in req_ids:
        step.add_request(req)
    outs = []
    for i in range(steps):
        fresh = [host.allocate(-(-(step.kv_len(r) + n) // host.tpb) - step.num_blocks(r)) for r, n in
                 zip(req_ids, num_new)]
        step.start(StepInput.of_lists(req_ids, num_new, fresh, mass=mass_of(i, rng.random((3, 40), np.float32))),
                   overlap=overlap)
        out = step.finish()
        host.release(out.table.freed.tolist())
        outs.append(out)
        num_new = [1, 1, 1]
    return outs, step, host


def new_blocks(step, host: Host, req_ids: list[int]) -> list[list[int]]:
    """One token more for each request: a block where its last is full."""
    return [host.allocate(1) if step.kv_len(r) == step.num_blocks(r) * host.tpb else [] for r in req_ids]


def test_a_mass_buffer_rewritten_in_place_or_a_new_array_repeats_the_call_as_the_whole_path():
    buffer = np.zeros((3, 40), np.float32)

    def in_place(i, values):
        buffer[:] = values  # a host's staging of its graph's static output
        return buffer

    repeated, step, host = h2o_loop(True, in_place)
    whole, reference, host_whole = h2o_loop(False, lambda i, values: values)
    new_arrays, fresh, host_fresh = h2o_loop(True, lambda i, values: values)  # a forward's output each step
    # The first two steps take the whole path (the prompt's counts, then the decode's), the rest repeat.
    assert step.stats.repeated_steps == fresh.stats.repeated_steps == len(repeated) - 2
    assert sum(len(o.victims) for o in repeated) > 40
    for a, b, c in zip(repeated, whole, new_arrays):
        outputs_equal(a, b)
        outputs_equal(c, b)
    tables_equal(step, reference)
    tables_equal(fresh, reference)
    assert torch.equal(host.kv, host_whole.kv) and torch.equal(host_fresh.kv, host_whole.kv)


def test_a_mass_of_another_dtype_or_a_tensor_takes_the_whole_path():
    """float32 arrays first (steps 0 and 1 take the whole path: the prompt's counts, then the
    decode's), then float64 arrays: the first of them takes the whole path, the next ones repeat
    with it; torch tensors: every step takes the whole path. The same victims as the whole path."""
    whole, _, _ = h2o_loop(False, lambda i, values: values, steps=8)
    for later, repeats in ((lambda values: values.astype(np.float64), 5), (torch.from_numpy, 0)):
        outs, step, _ = h2o_loop(True, lambda i, values: values if i < 2 else later(values), steps=8)
        assert step.stats.repeated_steps == repeats
        for a, b in zip(outs, whole):
            outputs_equal(a, b)


def test_a_mass_buffer_narrower_than_a_row_refuses_the_repeated_call_and_changes_nothing():
    """No eviction under a budget of 100: the rows grow a token a step, past the buffer's width."""
    narrow = np.zeros((3, 9), np.float32)  # rows of 6, 7, 8 tokens at the first decode step, 9 at the second
    outs, step, host = h2o_loop(True, lambda i, values: values[:, :9] if i == 0 else narrow, steps=3, budget=100)
    assert step.stats.repeated_steps == 1 and [step.kv_len(r) for r in (0, 1, 2)] == [7, 8, 9]
    blocks = new_blocks(step, host, [0, 1, 2])
    with pytest.raises(ValueError, match="the mass is narrower than request 2"):
        step.start(StepInput.of_lists([0, 1, 2], [1, 1, 1], blocks, mass=narrow), overlap=True)
    assert [step.kv_len(r) for r in (0, 1, 2)] == [7, 8, 9] and step.stats.repeated_steps == 1
    assert [step.num_blocks(r) for r in (0, 1, 2)] == [2, 2, 3]  # request 1's new block not taken
    wider = np.zeros((3, 16), np.float32)  # another array, wide enough: repeated
    for _ in range(2):
        step.start(StepInput.of_lists([0, 1, 2], [1, 1, 1], blocks, mass=wider), overlap=True)
        step.finish()
        blocks = new_blocks(step, host, [0, 1, 2])
    assert [step.kv_len(r) for r in (0, 1, 2)] == [9, 10, 11] and step.stats.repeated_steps == 3


def test_a_mass_the_step_reduces_across_ranks_is_never_repeated():
    """A reduction runs every step (its stats count each), even one returning the array it took."""
    reductions = []

    def reduce_mass(mass):
        reductions.append(mass)
        return mass

    buffer = np.zeros((3, 40), np.float32)
    outs, step, _ = h2o_loop(True, lambda i, values: buffer, steps=6, reduce_mass=reduce_mass)
    assert step.stats.repeated_steps == 0 and len(reductions) == 6
