# SPDX-License-Identifier: Apache-2.0
"""VTokenKVCacheManager driven by TensorRT-LLM's executor loop (the 1.2.1 double of
``PyExecutor``, ``trtllm121/.../py_executor.py``), in the loop's real order, not class by class.

The executor is built as the worker builds it (``create_py_executor`` behind vToken's start-up
hook, armed by the environment): the model engine, KvCacheCreator's estimation run (dummy
requests with ``max_tokens=1``, all finishing on their first token) through the loop, CUDA-graph
warm-up dummies, then the final executor. Random request mixes then run through it: prompts long
and short, some sharing a prefix (block reuse is on), ``max_tokens`` 1, an end id sampled as the
first token, cancellations, and a pool small enough that MAX_UTILIZATION pauses running requests
and prefills them again. After every ``update_resources``:

- TensorRT-LLM's block list of every request equals vToken's, and the request is dense;
- every live token's K and V, in every layer, are bit for bit what the forward wrote for it
  (recorded at the physical position the forward's metadata named, found again through vToken's
  table after any compaction): no token was lost, moved wrongly or overwritten;
- the step's invariant checks ran (I1/I2/I4);
- a paused request prefilled again starts a new table over its whole history (TensorRT-LLM made
  its generated tokens part of its prompt) and keeps its budget from that prefill on.
At the end every request has its response, vToken holds no table, and the pool's free blocks are
back to their count after warm-up. Where the host waits on the stream: ``test_trtllm_mass_waits.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from trtllm_vtoken.integration.trtllm import llm_args_dict
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings

TPB, BUDGET = 4, 12
POLICY_OPTIONS = {"streaming_llm": {"n_sink": 2}}


@dataclass
class Mix:
    seed: int
    num_requests: int = 36
    num_blocks: int = 40
    max_batch_size: int = 6


def build_executor(policy: str, mix: Mix, overlap: bool = False, block_reuse: bool = True,
                   chunked: tuple[int, str] | None = None, policy_options: dict | None = None,
                   copy_on_partial_reuse: bool = True, decode_decision: str = "at_once", **llm_args):
    """The executor the worker builds, vToken armed through the environment. ``chunked``:
    chunked prefill with (``max_num_tokens``, ``context_chunking_policy``); ``decode_decision``:
    ``VTokenSettings.decode_decision``; ``llm_args``: more ``TorchLlmArgs`` fields
    (``speculative_config``, ...)."""
    import os

    options = POLICY_OPTIONS.get(policy, {}) if policy_options is None else policy_options
    settings = VTokenSettings(policy=policy, budget=BUDGET, policy_options=options,
                              check_invariants=True, decode_decision=decode_decision)
    os.environ.update(settings.worker_environment())
    from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    args = llm_args_dict(tokens_per_block=TPB)
    args["kv_cache_config"]["max_tokens"] = mix.num_blocks * TPB
    args["kv_cache_config"]["enable_block_reuse"] = block_reuse  # and partial reuse, TensorRT-LLM's default
    args["kv_cache_config"]["copy_on_partial_reuse"] = copy_on_partial_reuse
    if chunked is not None:
        args["scheduler_config"]["context_chunking_policy"] = chunked[1]
    llm_args = TorchLlmArgs(model="tiny", max_batch_size=mix.max_batch_size,
                            max_num_tokens=chunked[0] if chunked else 256, enable_chunked_prefill=chunked is not None,
                            max_seq_len=96, max_input_len=96, disable_overlap_scheduler=not overlap, **args,
                            **llm_args)
    return create_py_executor(llm_args=llm_args)


def random_requests(mix: Mix):
    """(request, arrival iteration, cancel at iteration or None), drawn from ``mix.seed``."""
    from tensorrt_llm._torch.pyexecutor._util import greedy_token
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig

    rng = random.Random(mix.seed)
    prefix = [rng.randrange(2, 500) for _ in range(9)]
    out = []
    for i in range(mix.num_requests):
        length = rng.choice([1, 2, 5, 11, 17, 26, 35])
        prompt = [rng.randrange(2, 500) for _ in range(length)]
        if rng.random() < 0.3:
            prompt = prefix + prompt
        max_new = rng.choice([1, 1, 3, 9, 20, 30])
        req = LlmRequest(request_id=100 + i, max_new_tokens=max_new, input_tokens=prompt,
                         sampling_config=SamplingConfig(1))
        if rng.random() < 0.15:
            req.py_end_id = greedy_token(req)  # the first token sampled ends it
        cancel = rng.randrange(3, 60) if rng.random() < 0.12 else None
        out.append((req, rng.randrange(0, 90), cancel))
    return out


class KVWitness:
    """What the forward wrote for each token, and the check that it is still there."""

    def __init__(self, executor, token_ahead: bool | None = None) -> None:
        """``token_ahead``: TensorRT-LLM may hold the next batch's token beyond the table's (default:
        for count-based policies, which take it in before that batch's forward, and for
        attention-observing ones deciding at once, whose requests that may evict do)."""
        self.executor = executor
        self.token_ahead = token_ahead
        self.manager = executor.resources["kv_cache_manager"]
        self.written: dict[tuple[int, int], list[torch.Tensor]] = {}  # (request, logical position) -> [layer K/V]
        self.checks = 0

    def _read(self, blocks: list[int], positions) -> torch.Tensor:
        """[len(positions), layers, kv, heads, head_dim]: a copy of the KV at those physical
        positions of a request holding ``blocks`` (one gather per layer)."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        block, offset = torch.as_tensor(blocks, dtype=torch.long)[positions // TPB], positions % TPB
        return torch.stack([self.manager.get_buffers(layer, kv_layout="HND")[block, :, :, offset]
                            for layer in self.manager.pp_layers], dim=1)

    def after_forward(self, batch) -> None:
        """Records each real row's new tokens where the forward's metadata put them."""
        engine = self.executor.model_engine
        metadata, seq_lens = engine.attn_metadata, engine.attn_metadata.seq_lens.tolist()
        for row, req in enumerate(batch.context_requests + batch.generation_requests):
            kv_len, first_logical = int(metadata.kv_lens[row]), engine.row_positions[row]
            blocks = self.manager.get_cache_indices(req)
            if row < len(batch.context_requests) and req.is_first_context_chunk:  # a prefix from the reuse tree
                for position, kv in enumerate(self._read(blocks, range(first_logical))):
                    self.written[(req.py_request_id, position)] = kv
            new = self._read(blocks, range(kv_len - seq_lens[row], kv_len))
            for i, kv in enumerate(new):
                self.written[(req.py_request_id, first_logical + i)] = kv

    def after_update(self) -> None:
        step = self.manager.vtoken.step
        requests = {r.py_request_id: r for r in self.executor.active_requests}
        for req_id in step.request_ids():
            blocks = step.block_ids(req_id)
            held = self.manager.get_cache_indices(_Ref(req_id))
            kv_len = step.kv_len(req_id)
            # Beyond the table's tokens TensorRT-LLM holds the prompt's chunks still to come
            # (allocated at the first chunk) and, for a count-based policy, the next batch's
            # token, which that policy takes in before that batch's forward (prepare_resources);
            # so does any policy for a batch stepped there (one with a prompt chunk to continue,
            # or, deciding at once, a request whose step may evict).
            unwritten = max(0, requests[req_id].prompt_len - step.num_tokens(req_id)) if req_id in requests else 0
            ahead_by_default = not step.policy.observes_attention() or \
                self.manager.vtoken.settings.decode_decision == "at_once"
            extra = int(ahead_by_default if self.token_ahead is None else self.token_ahead)
            ahead = self.manager.num_tokens_in_sequence(req_id) - kv_len
            assert held[: len(blocks)] == blocks and unwritten <= ahead <= unwritten + extra, \
                f"request {req_id}: TensorRT-LLM holds {held} ({ahead} tokens ahead), vToken {blocks}"
            self.ahead_seen = max(getattr(self, "ahead_seen", 0), unwritten)
            assert kv_len == step.num_live(req_id), f"request {req_id} is not dense"
            logical = step.batch_tokens([req_id])[0][:kv_len].tolist()
            if not logical:
                continue
            want = torch.stack([self.written[(req_id, token)] for token in logical])
            got = self._read(blocks, range(kv_len))
            if not torch.equal(got, want):
                position = next(p for p in range(kv_len) if not torch.equal(got[p], want[p]))
                raise AssertionError(f"request {req_id}: token {logical[position]}'s KV at position {position} "
                                     "is not what was written")
            self.checks += kv_len


def trace_victims(manager) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """From now on, per request: (tokens its table knows, victims) after every step of the manager."""
    run, trace = manager.vtoken.run, {}

    def traced(*args, **kwargs):
        out = run(*args, **kwargs)
        if out is not None:
            for i, req_id in enumerate(out.req_ids.tolist()):
                trace.setdefault(req_id, []).append((manager.vtoken.step.num_tokens(req_id), tuple(out.victims_of(i))))
        return out

    manager.vtoken.run = traced
    return trace


def held_by_padding(executor) -> int:
    """Blocks the model engine's CUDA-graph padding dummy holds (made once, kept for the executor's life)."""
    padding = executor.model_engine.padding_dummy_request
    manager = executor.resources["kv_cache_manager"]
    return len(manager.get_cache_indices(padding)) if padding is not None else 0


class _Ref:
    def __init__(self, req_id: int) -> None:
        self.py_request_id = req_id


def drive(executor, requests, witness: KVWitness, overlap: bool = False) -> dict:
    """Runs the loop over ``requests`` with the witness after every forward and update."""
    resource_manager, engine = executor.resource_manager, executor.model_engine
    update, forward = resource_manager.update_resources, engine.forward
    cancels = {req.py_request_id: at for req, _, at in requests if at is not None}
    seen = {"updates": 0, "paused": 0, "prefilled_again": 0}
    paused_ids: set[int] = set()

    def executor_next() -> set[int]:  # the requests of the batch in flight (overlap: prepared after this one)
        return {r.py_request_id for r in executor.previous_batch.scheduled_requests.all_requests()} \
            if executor.previous_batch is not None else set()

    def forward_then_record(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs)
        witness.after_forward(batch)
        for req_id, at in list(cancels.items()):
            if executor.iter_counter >= at:
                executor.cancel_request(req_id)
                del cancels[req_id]
        return out

    def update_then_check(batch, *args, **kwargs):
        update(batch, *args, **kwargs)
        seen["updates"] += 1
        witness.after_update()
        step = witness.manager.vtoken.step
        for req in batch.context_requests:  # a paused request prefilled again: a new table, the budget at once
            if req.py_request_id in paused_ids and req.py_request_id in step and not req.is_context_init_state():
                held_prefix = req.prompt_len // TPB * TPB  # its prompt's full blocks, protected (block reuse)
                known = step.num_tokens(req.py_request_id)  # under overlap: and the next forward's token
                # Under overlap an observing policy deciding lagged takes the next batch's token in
                # too; deciding at once, its steps take in the batch's own tokens only.
                lags = overlap and step.policy.observes_attention() and req.py_request_id in executor_next() \
                    and witness.manager.vtoken.settings.decode_decision == "lagged"
                assert known == req.prompt_len + lags
                assert step.num_live(req.py_request_id) <= step.policy.budget.target(known - held_prefix) + held_prefix
                seen["prefilled_again"] += 1

    pause = executor._pause_requests

    def count_pauses(paused):
        seen["paused"] += len(paused)
        paused_ids.update(r.py_request_id for r in paused)
        return pause(paused)

    resource_manager.update_resources, engine.forward = update_then_check, forward_then_record
    executor._pause_requests = count_pauses
    for req, arrival, _ in requests:
        executor.enqueue_request(req, arrival)
    executor.run()
    return seen


@pytest.mark.parametrize("loop", ["plain", "overlap"])
@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "sliding_window", "random", "scissorhands"])
def test_random_request_mixes_through_the_executor_loop(trtllm121, policy, loop):
    totals = {"iterations": 0, "paused": 0, "prefilled_again": 0, "checks": 0, "copied": 0, "taken over": 0}
    for seed in (1, 2, 3):
        # Under the overlap loop TensorRT-LLM 1.2's MAX_UTILIZATION counts a request's next block
        # one token late (its host tokens lag the KV by the batch in flight, and the lookahead is
        # one step without pipeline parallelism): a pool that small runs dry with no vToken at
        # all. There, the pool holds every request's whole length, so nothing is paused.
        mix = Mix(seed, num_blocks=40 if loop == "plain" else 120)
        executor = build_executor(policy, mix, overlap=loop == "overlap", copy_on_partial_reuse=seed != 2)
        assert executor.event_loop.__name__ == ("_executor_loop_overlap" if loop == "overlap" else "_executor_loop")
        manager = executor.resources["kv_cache_manager"]
        assert type(manager).__qualname__.startswith("VTokenKVCacheManager")
        free_after_warmup = manager.get_num_free_blocks()
        requests = random_requests(mix)
        witness = KVWitness(executor)
        seen = drive(executor, requests, witness, overlap=loop == "overlap")
        for req, _, cancel in requests:
            response = executor.responses[req.py_request_id]
            reason = response.finish_reason.name
            assert reason in ("END_ID", "LENGTH", "CANCELLED"), (req.py_request_id, reason)
            if reason == "END_ID":
                assert req.py_end_id == response.tokens[-1]
            if reason == "LENGTH":
                assert len(response.tokens) == req.py_max_new_tokens
            if cancel is None:
                assert reason != "CANCELLED"
        step = manager.vtoken.step
        assert not step.request_ids() and not manager._vtoken_held
        assert manager.get_num_free_blocks() == free_after_warmup - held_by_padding(executor)
        assert step.stats.tokens_evicted > 0 and step.stats.invariant_checks > 0
        totals["iterations"] += executor.iter_counter
        totals["paused"] += seen["paused"]
        totals["prefilled_again"] += seen["prefilled_again"]
        totals["checks"] += witness.checks
        for kind, hits in manager.impl.partial_hits.items():
            totals[kind] += hits
    print(policy, totals)
    assert totals["copied"] > 0 and totals["taken over"] > 0  # partial reuse (on by default) matched
    if loop == "plain":  # the pool was small enough to pause and prefill again
        assert totals["paused"] > 0 and totals["prefilled_again"] > 0
    assert totals["iterations"] > 300 and totals["checks"] > 3000


@pytest.mark.parametrize("policy", ["streaming_llm", "sliding_window", "random", "h2o", "scissorhands"])
def test_every_policy_decides_in_the_overlap_loop_as_in_the_plain_loop(trtllm121, policy):
    """StreamingLLM, sliding window and Random decide from counts: under _executor_loop_overlap
    the manager takes batch N's tokens in at prepare_resources(N+1), before _forward_step(N+1)
    (no lag). H2O and Scissorhands (``decode_decision="at_once"``, the default) step there the
    requests whose step may evict with N+1's token, from forward N's mass, and the others in
    update_resources(N), where they evict nothing. So every request's victims, registration by
    registration, are the plain loop's. The same mix in both loops, a pool that pauses nobody;
    cancelled requests are left out (the loops cancel at the same iteration, not the same token)."""
    decisions = {}
    for loop in ("plain", "overlap"):
        mix = Mix(2, num_blocks=120)
        executor = build_executor(policy, mix, overlap=loop == "overlap")
        trace = trace_victims(executor.resources["kv_cache_manager"])
        requests = random_requests(mix)
        seen = drive(executor, requests, KVWitness(executor), overlap=loop == "overlap")
        assert seen["paused"] == 0
        cancelled = {req.py_request_id for req, _, _ in requests
                     if executor.responses[req.py_request_id].finish_reason.name == "CANCELLED"}
        decisions[loop] = {r: t for r, t in trace.items() if r not in cancelled and r >= 100}
    plain, overlap = decisions["plain"], decisions["overlap"]
    for req_id, got in overlap.items():
        # A request that finishes with batch N was prepared for N+1 already: its N-th tokens are
        # taken in before the loop learns it finished (a decision no forward it decodes reads;
        # a request finished by its prefill's token is stepped once, the plain loop never steps it).
        want = plain.get(req_id, [])
        assert got[: len(want)] == want and len(got) - len(want) in (0, 1), req_id
    assert plain.keys() <= overlap.keys()
    assert sum(len(v) for t in decisions["plain"].values() for _, v in t) > 0


def test_h2o_lagged_in_the_overlap_loop_decides_a_batch_late(trtllm121):
    """``decode_decision="lagged"``: every step in update_resources(N), which counts forward
    N+1's token already: the victims move against the plain loop's (the lag is real)."""
    traces = {}
    for loop, decision in (("plain", "at_once"), ("overlap", "lagged")):
        mix = Mix(2, num_blocks=120)
        executor = build_executor("h2o", mix, overlap=loop == "overlap", decode_decision=decision)
        traces[loop] = trace_victims(executor.resources["kv_cache_manager"])
        drive(executor, random_requests(mix), KVWitness(executor), overlap=loop == "overlap")
    victims = {loop: {r: [v for _, v in t if v] for r, t in trace.items() if r >= 100} for loop, trace in traces.items()}
    assert any(victims["plain"][r] != victims["overlap"][r] for r in victims["plain"].keys() & victims["overlap"].keys())
