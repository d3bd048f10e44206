# SPDX-License-Identifier: Apache-2.0
"""The C++ core's call on the step's worker thread (``DecodeStep.start`` with overlap, then
``finish``) equals the call made at once (``run``): the same random batches under each policy
(decided natively or in Python) and each compaction give the same victims, moves, freed blocks, lengths, tables,
layouts and KV, with I1/I2 checked around every step, whether the host waits in ``finish`` or a
query or a request leaving waits for it first. Misuse and a failing call raise as ``run`` does; an
engine overlapping its sampling with the step produces what it produces without."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.step.drive import POLICY_SPECS, Host, join_some, make_step, same_batches, share_a_block
from tests.step.test_step_parity import outputs_equal, tables_equal
from trtllm_vtoken.core.native import batch_refused, load
from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")

@settings(max_examples=40, deadline=None)
@given(compaction=st.sampled_from(["dense", "lazy", "dead-blocks", "lazy-background"]), tpb=st.sampled_from([2, 4, 8]),
       spec=st.sampled_from(POLICY_SPECS + [None]), steps=st.integers(1, 16), seed=st.integers(0, 2**31),
       checks=st.booleans())
def test_the_call_on_the_worker_equals_the_call_at_once(compaction, tpb, spec, steps, seed, checks):
    """``checks`` off, the call on the worker registers the batch too where it decides itself (the
    invariant checks, and a decision made in Python, read the registered layout before it, so then
    the host's thread registers it); the step at once keeps its checks."""
    rng = np.random.default_rng(seed)
    hosts = [Host(256, tpb, 1) for _ in range(2)]
    policies = [None if spec is None else make_policy(spec[0], spec[1], **spec[2]) for _ in hosts]
    at_once = make_step(hosts[0], "cpp", compaction, 2, policies[0])
    beside = make_step(hosts[1], "cpp", compaction, 2, policies[1], checks=checks)
    registered_here = count_registrations(beside)
    both, next_req = (at_once, beside), 0
    for _ in range(steps):
        joining = join_some(rng, both, next_req)
        next_req += len(joining)
        if not at_once.request_ids():
            continue
        share_a_block(rng, list(both), hosts, 0.15)
        inputs = same_batches(rng, list(both), hosts, joining)
        expected = at_once.run(inputs[0])
        beside.start(inputs[1], overlap=True)
        leaving = [r for r in inputs[1].req_ids if rng.random() < 0.08]
        if rng.random() < 0.3:  # a query while the call is in flight waits for it
            assert beside.counters(inputs[1].req_ids) == at_once.counters(inputs[0].req_ids)
        for req in leaving:  # a request of the batch leaves while the call is in flight
            for step, host in zip(both, hosts):
                host.release(b for b in step.remove_request(req) if b not in host.shared)
        got = beside.finish()
        outputs_equal(expected, got)
        for host, out in zip(hosts, (expected, got)):
            host.release(out.table.freed)
        tables_equal(at_once, beside)
        assert torch.equal(hosts[0].kv, hosts[1].kv)
        assert beside.stats.compactions == at_once.stats.compactions
    assert beside.stats.overlapped_steps == beside.stats.steps == at_once.stats.steps
    assert beside.stats.native_decisions == at_once.stats.native_decisions
    assert at_once.stats.overlapped_steps == 0
    if not checks:  # the host's thread registered only the batches decided in Python
        assert registered_here[0] == beside.stats.steps - beside.stats.native_decisions


def test_the_call_registers_a_batch_checked_first():
    """Registration in the native call, at once and on the worker (no invariant checks, no mass
    function): lists outgrowing the block table widen it before the call; a bad batch raises
    ValueError at ``start`` in the Python core's words, nothing changed, and the step goes on."""
    outs, messages, counters = {}, {}, {}
    for overlap in (False, True):
        host = Host(64, 2)
        step = make_step(host, "cpp", "dense", policy=make_policy("streaming_llm", 30, n_sink=2), checks=False)
        registered_here = count_registrations(step)
        step.add_request(0)
        width = step.slots.block_table.shape[1]
        step.start(StepInput([0], [21], [0, 11], host.allocate(11)), overlap=overlap)  # 11 blocks
        outs[overlap] = [step.finish()]
        assert step.slots.block_table.shape[1] > width and len(step.block_ids(0)) == 11
        before = step.counters([0])
        with pytest.raises(ValueError, match="new block ids must lie in") as caught:
            step.start(StepInput.decode([0], [[999]]), overlap=overlap)
        assert type(caught.value) is ValueError  # the C++ core's BatchRefused, said as the Python core says it
        messages[overlap], counters[overlap] = str(caught.value), step.counters([0])
        assert counters[overlap] == before  # and nothing in flight: the next step starts
        for not_lists in ([7], [[1.5]], [["a"]], [[2**63]]):  # one sequence of ints per request
            with pytest.raises(ValueError, match="one sequence of block ids per request"):
                step.start(StepInput([0], [1], None, not_lists), overlap=overlap)
            assert step.counters([0]) == before
        step.start(StepInput.decode([0], [host.allocate(1)]), overlap=overlap)
        outs[overlap].append(step.finish())
        assert registered_here[0] == 0 and step.stats.overlapped_steps == (2 if overlap else 0)
    assert messages[False] == messages[True] and counters[False] == counters[True]
    for a, b in zip(outs[False], outs[True]):
        outputs_equal(a, b)


def count_registrations(step: DecodeStep) -> list[int]:
    """Counts the step's registrations on the host's thread (``SlotMap.add_tokens``)."""
    made, add_tokens = [0], step.slots.add_tokens

    def counted(*args):
        made[0] += 1
        return add_tokens(*args)

    step.slots.add_tokens = counted
    return made


def test_misuse_and_a_failing_call_raise_as_run_does():
    host = Host(16, 4)
    step = make_step(host, "cpp", "dense", policy=make_policy("h2o", 6))
    step.add_request(0)
    with pytest.raises(RuntimeError, match="no step was started"):
        step.finish()
    step.start(StepInput([0], [5], [0, 2], host.allocate(2), mass=np.ones((1, 8))), overlap=True)
    with pytest.raises(RuntimeError, match="has not been finished"):
        step.start(StepInput.decode([0], mass=np.ones((1, 8))), overlap=True)
    assert step.finish().lost.tolist() == [0] and step.stats.overlapped_steps == 1
    messages = []
    for overlap in (False, True):  # the token table refuses the step on either thread alike
        host = Host(16, 4)
        step = DecodeStep(StepConfig("dense", impl="cpp"), 16, 4, make_policy("h2o", 6))  # no checks: the call fails
        step.add_request(0)
        step.core.table.remove_request(0)  # behind the step's back: the table no longer knows it
        with pytest.raises(RuntimeError, match="refused a step") as caught:  # at once, or where it waits
            step.start(StepInput([0], [5], [0, 2], host.allocate(2), mass=np.ones((1, 8))), overlap=overlap)
            assert overlap
            step.finish()
        with pytest.raises(RuntimeError, match="unusable"):
            step.run(StepInput.decode([0], mass=np.ones((1, 8))))
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_the_worker_binding_checks_at_start_and_raises_at_wait():
    """``DecodeWorker``: bad arguments are refused at start (nothing in flight); an error inside
    the call comes back from wait (KeyError for an unknown request) and leaves it idle."""
    host = Host(16, 4)
    step = make_step(host, "cpp", "dense", policy=make_policy("streaming_llm", 6, n_sink=2))
    step.add_request(0)
    step.run(StepInput([0], [5], [0, 2], host.allocate(2)))
    native, worker = step.slots.native, step.slots.native.DecodeWorker()
    ids = np.array([0], dtype=np.int64)
    args = (step.slots.native_layout(), step.core.table, ids, np.array([0], dtype=np.int64), np.ones(1, np.int64),
            np.zeros(2, np.int64), np.zeros(0, np.int64), 1, (6, 1.0, 2, 0, 0.0, 1), 0, 1, False)
    with pytest.raises(ValueError, match="selector must be 0-3"):
        worker.start(*args[:7], 7, *args[8:])
    assert not worker.busy
    with pytest.raises(RuntimeError, match="no step in flight"):
        worker.wait()
    registering = (*args, None, None, False, 1, None, step.slots.num_blocks)  # the call registers the batch first
    with pytest.raises(batch_refused(), match="must lie in"):  # checked at start as slots_register checks it
        worker.start(*registering[:5], np.array([0, 1]), np.array([99]), *registering[7:])
    assert not worker.busy
    assert worker.start(*registering[:5], np.array([0, 9]), np.arange(5, 14), *registering[7:]) == 2 + 9
    assert not worker.busy  # 11 columns needed, the block table has 8: nothing started
    step.core.table.remove_request(0)
    worker.start(*args)
    assert worker.busy
    with pytest.raises(KeyError):
        worker.wait()
    assert not worker.busy
    assert native is not None


def test_the_packed_result_becomes_an_array_only_when_a_part_is_read():
    """``FusedOutput``: a step that evicted, moved and freed nothing gives its counts without the
    buffer's array; the first part read makes it (once: ``PackedBuffer.array`` refuses a second
    taking), and each part is read from it."""
    host = Host(16, 4)
    step = make_step(host, "cpp", "dense", policy=make_policy("streaming_llm", 6, n_sink=2), checks=False)
    step.add_request(0)
    step.start(StepInput([0], [5], [0, 2], host.allocate(2)), overlap=True)
    out = step.finish()
    assert (out.num_evicted, out.num_moves, out.num_freed, out.num_changed) == (0, 0, 0, 0)
    assert "_flat" not in vars(out)  # the counts alone: no array made
    buffer = out._buffer
    assert out.table.kv_lens.tolist() == [5] and out.num_tokens.tolist() == [5] and out.lost.tolist() == [0]
    assert len(buffer) == len(out._flat) == out._fixed  # nothing but the per-request parts
    with pytest.raises(RuntimeError, match="taken already"):
        buffer.array()
    step.start(StepInput([0], [4], [0, 1], host.allocate(1)), overlap=True)  # 9 tokens over a budget of 6
    out = step.finish()
    assert (out.num_evicted, out.num_moves, out.num_freed) == (3, 3, 1)
    assert "table" not in vars(out)  # the copy read its two parts (moved_slots), not the whole table
    assert [part.tolist() for part in out.moved_slots()] == [[8, 7, 6], [2, 3, 4]]
    assert out.victims.tolist() == [2, 3, 4] and out.table.move_dst.tolist() == [2, 3, 4]
    assert len(out._buffer) == out._fixed + 3 + 3 * 3 + 1


def test_the_pass_leaves_a_core_to_the_host_beside_it():
    config = StepConfig(threads=0)
    assert config.pass_threads(beside_host=True) == max(1, config.pass_threads() - 1)
    assert StepConfig(threads=3).pass_threads(beside_host=True) == 3  # as the host set it


@pytest.mark.parametrize("policy,mode", [("h2o", "dense"), ("streaming_llm", "lazy"), ("h2o", "lazy")])
def test_an_engine_sampling_beside_the_step_produces_the_same(policy, mode):
    """The simulated backend's engine, requests finishing at different steps (a request that
    finishes leaves after the step, which waits for the call first): the same tokens, evictions,
    step counters and free blocks with the call on the worker as without; only there is it
    overlapped.
    With prefix caching its cut runs after the call on the worker, with the block lists the decision
    saw: the same results, every step overlapped."""
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel

    def run(overlap: bool, prefix_caching: bool):
        config = EngineConfig(tokens_per_block=4, num_blocks=128, max_batch_size=4, max_seq_len=96, policy=policy,
                              mode=mode, budget=12, step_impl="cpp", step_overlap=overlap,
                              prefix_caching=prefix_caching)
        engine = Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"], mass_dtype=np.float32), config,
                        record_trace=True)
        ids = [engine.add_request([1, 0] * (5 + i), SamplingParams(max_tokens=10 + 7 * i, ignore_eos=True))
               for i in range(6)]
        free = engine.kv.num_available
        while engine.has_unfinished():
            engine.step()
        assert engine.kv.num_available == free  # every block back (or cached, free-able)
        stats = engine.kv.step_stats
        return ([(engine.requests[r].output_ids, engine.requests[r].evictions) for r in ids],
                (stats.steps, stats.tokens_evicted, stats.moves, stats.blocks_freed, stats.native_decisions),
                stats.overlapped_steps, engine.kv.num_available,
                engine.kv.prefix.cache.stats if prefix_caching else None)

    for prefix_caching in (False, True):
        without, beside = run(False, prefix_caching), run(True, prefix_caching)
        assert beside[:2] == without[:2] and beside[3:] == without[3:]  # every block back, the same prefix hits
        if prefix_caching:  # shared prefixes were hit and chains cut
            assert beside[4].hit_tokens > 0 and beside[4].dropped_keys > 0
        assert without[1][1] > 0 and without[2] == 0
        assert beside[2] == beside[1][0] == beside[1][4] > 0  # every step overlapped, prefix caching's cut after it


def test_a_decode_loop_passing_the_same_lists_is_checked_as_any():
    """The step reuses the arrays of the last batch's lists when the host passes equal ones (a
    decode loop) and no request joined or left: the same outputs; a request that left is still
    unknown, a changed list is read anew."""
    host = Host(32, 4)
    step = make_step(host, "cpp", "dense", policy=make_policy("streaming_llm", 6, n_sink=2))
    for req in (0, 1):
        step.add_request(req)
    step.run(StepInput([0, 1], [4, 4], [0, 1, 2], host.allocate(2)))
    req_ids, num_new = [0, 1], [1, 1]
    first = step.run(StepInput(req_ids, num_new, [0, 1, 2], host.allocate(2)))
    again = step.run(StepInput(req_ids, num_new, [0, 0, 0], []))
    assert again.req_ids.base is first.req_ids.base and not again.req_ids.flags.writeable  # reused, read-only
    assert again.num_tokens.tolist() == [6, 6]
    host.release(step.remove_request(1))
    with pytest.raises(KeyError, match="unknown request 1"):
        step.run(StepInput(req_ids, num_new, [0, 0, 0], []))
    assert step.run(StepInput([0], [2], [0, 0], [])).num_tokens.tolist() == [8]


def test_a_call_started_after_the_workers_naps_runs_as_one_started_while_it_naps():
    """The worker naps for 5 ms after each call (``cpp/core/step_worker.h``) and then blocks: a
    host that starts its next call while it naps (no wait) and one that starts it later (20 ms:
    the worker blocked, the start notifies it) get what the step made at once gets, and the
    repeated call (the same lists each step) serves both."""
    hosts = [Host(64, 4) for _ in range(2)]
    at_once, beside = (make_step(host, "cpp", "dense", policy=make_policy("streaming_llm", 6, n_sink=2),
                                 checks=checks) for host, checks in zip(hosts, (True, False)))
    for step, host in zip((at_once, beside), hosts):
        for req in (0, 1):
            step.add_request(req)
    first = [StepInput([0, 1], [4, 4], [0, 1, 2], host.allocate(2)) for host in hosts]
    outputs_equal(at_once.run(first[0]), beside.run(first[1]))
    req_ids, num_new, kv_lens = [0, 1], [1, 1], [4, 4]
    for pause in (0.0, 0.02, 0.0, 0.02, 0.0, 0.0, 0.02):
        time.sleep(pause)
        inputs = [StepInput.of_lists(req_ids, num_new, [host.allocate(1) if n % 4 == 0 else [] for n in kv_lens])
                  for host in hosts]
        expected = at_once.run(inputs[0])
        beside.start(inputs[1], overlap=True)
        got = beside.finish()
        outputs_equal(expected, got)
        for host, out in zip(hosts, (expected, got)):
            host.release(out.table.freed.tolist())
        kv_lens = expected.table.kv_lens.tolist()
    assert beside.stats.overlapped_steps == 7 and beside.stats.repeated_steps > 0


@pytest.mark.parametrize("compaction", ["dense", "lazy"])
@pytest.mark.parametrize("checks", [True, False])
def test_the_victims_hook_beside_the_host_sees_what_it_sees_at_once(compaction, checks):
    """The hook (prefix caching's cut) gets the same victims and each request's block list as the
    decision saw it, though beside the host it runs after the call, when lazy compaction has already
    released blocks from the middle of the lists. ``checks`` off, the call on the worker registers
    the batch too: the lists copied before it gain the new blocks it registered."""
    seen: dict[bool, list] = {False: [], True: []}
    outs: dict[bool, list] = {False: [], True: []}
    for overlap in (False, True):
        host = Host(64, 4)
        step = make_step(host, "cpp", compaction, policy=make_policy("h2o", 5), checks=checks or not overlap)
        registered_here = count_registrations(step)

        def on_victims(req_ids, offsets, victims, block_ids, overlap=overlap, step=step):
            evicting = [int(r) for r, n in zip(req_ids, np.diff(offsets)) if n]
            seen[overlap].append((req_ids.tolist(), offsets.tolist(), victims.tolist(),
                                  [block_ids(r) for r in evicting]))

        step.on_victims = on_victims
        rng = np.random.default_rng(5)
        for req in range(3):
            step.add_request(req)
        prompts = [host.allocate(3) for _ in range(3)]
        mass = rng.random((3, 12), dtype=np.float32)
        step.start(StepInput([0, 1, 2], [11, 10, 9], [0, 3, 6, 9], sum(prompts, []), mass=mass), overlap=overlap)
        outs[overlap].append(step.finish())
        for _ in range(6):
            extra = [host.allocate(1) if step.kv_len(r) == step.num_blocks(r) * 4 else [] for r in range(3)]
            inp = StepInput([0, 1, 2], [1, 1, 1], np.cumsum([0] + [len(e) for e in extra]), sum(extra, []),
                            mass=rng.random((3, 16), dtype=np.float32))
            step.start(inp, overlap=overlap)
            out = step.finish()
            host.release(out.table.freed)
            outs[overlap].append(out)
        assert step.stats.overlapped_steps == (7 if overlap else 0)
        assert registered_here[0] == (0 if overlap and not checks else 7)
    assert seen[False] == seen[True] and len(seen[True]) == 7
    assert any(len(lists) and len(lists[0]) == 3 for *_, lists in seen[True])  # lists before the release
    for a, b in zip(outs[False], outs[True]):
        outputs_equal(a, b)
    if compaction == "lazy":
        assert sum(len(o.table.freed) for o in outs[True]) > 0  # blocks left the lists after the call


def test_a_mass_function_makes_the_host_register_its_lists_as_the_call_would():
    """A mass function reads the registered layout, so the host's thread registers the batch
    before it (``SlotMap.add_tokens``): the C++ core takes the host's lists as they are and makes
    no slots array unless the invariant checks read it. Same outputs, tables and layouts as with
    the checks on and as the Python core's registration of the same batches in CSR form."""

    def mass(tokens: np.ndarray) -> np.ndarray:  # attention per physical slot, a function of the layout
        return np.where(tokens >= 0, (tokens % 7 + 1) / 7.0, 0.0).astype(np.float32)

    runs = []
    for impl, checks in (("cpp", False), ("cpp", True), ("python", True)):
        host = Host(64, 4)
        step = make_step(host, impl, "dense", policy=make_policy("h2o", 6), checks=checks)
        registered, add_tokens = [], step.slots.add_tokens
        step.slots.add_tokens = lambda *args, add=add_tokens, seen=registered: seen.append(add(*args)) or seen[-1]
        for req in range(3):
            step.add_request(req)
        lengths, outs = [0, 0, 0], []
        for num_new in ([5, 6, 7], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]):
            blocks = [host.allocate(-(-(n + k) // 4) - -(-n // 4)) for n, k in zip(lengths, num_new)]
            outs.append(step.run(StepInput.of_lists([0, 1, 2], num_new, blocks, mass=mass)))
            host.release(outs[-1].table.freed.tolist())
            lengths = outs[-1].table.kv_lens.tolist()  # dense: a request holds just the blocks for these
        assert len(registered) == 5  # every step registered on the host's thread
        assert sum(len(out.victims) for out in outs) >= 3 * 4 and sum(len(out.table.move_src) for out in outs)
        if impl == "cpp":
            assert all((s is None) == (not checks) for s in registered)  # slots only where checks read them
        runs.append((step, outs))
    for step, outs in runs[1:]:
        for a, b in zip(runs[0][1], outs):
            outputs_equal(a, b)
        tables_equal(runs[0][0], step)
