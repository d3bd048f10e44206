# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM adapter at tensor / pipeline parallelism > 1, over the 1.2.1 doubles: each
simulated rank is a thread (standing for a worker process) with its own ``VTokenKVCacheManager``
holding only its heads (TP) or its layers (PP), talking over the double of TensorRT-LLM's MPI
communicator (``tensorrt_llm._utils.mpi_comm``), which really sums between them. Every rank must
then take the decisions a single GPU holding all heads and layers takes, and with
``check_invariants`` a rank that scores from a different mass is caught in the step it diverges."""

from __future__ import annotations

import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.integration.test_trtllm_adapter import DIM, TPB, make_manager
from tests.integration.trtllm121 import tensorrt_llm as trtllm_double
from tests.integration.trtllm121.tensorrt_llm import _utils as utils_double
from tests.integration.trtllm_doubles import Mapping, ScheduledRequests, TrtllmAttention, TrtllmAttentionMetadata, \
    make_request
from trtllm_vtoken.consistency import RankDivergenceError
from trtllm_vtoken.integration.trtllm.patches import record_queries
from trtllm_vtoken.integration.trtllm.ranks import MASS_SCALE, MpiRanks

LAYERS, KV_HEADS, HEADS = 4, 2, 4  # the whole model; ranks hold slices
PROMPTS = (14, 9, 17)
BUDGET = 10
OPTIONS = {"h2o": {"recent_ratio": 0.2, "recent_window": 2}, "scissorhands": {"recent_window": 2, "history_window": 4}}
SHARPNESS = 4.0
"""Query scale: peaked attention, so which tokens a policy keeps depends on the mass, not only
on recency."""


@pytest.fixture(autouse=True)
def trtllm_utils(monkeypatch):
    """``import tensorrt_llm._utils`` finds the double (only for these tests)."""
    monkeypatch.setitem(sys.modules, "tensorrt_llm", trtllm_double)
    monkeypatch.setitem(sys.modules, "tensorrt_llm._utils", utils_double)


class Model:
    """The whole model's KV and queries, a function of (request, logical token) and (request,
    step): every rank reads its slice of the same numbers."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def _randn(self, *key_and_shape):
        *key, shape = key_and_shape
        gen = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, *key)).encode()))  # not hash(): salted
        return torch.randn(shape, generator=gen)

    def kv(self, req_id: int, token: int) -> torch.Tensor:  # [layers, 2, kv_heads, dim]
        return self._randn("kv", req_id, token, (LAYERS, 2, KV_HEADS, DIM))

    def q(self, req_id: int, step: int, num_tokens: int = 1) -> torch.Tensor:  # [layers, tokens, heads, dim]
        return SHARPNESS * self._randn("q", req_id, step, (LAYERS, num_tokens, HEADS, DIM))


class Rank:
    """One simulated rank: its manager, the global layers and the heads it holds."""

    def __init__(self, mapping: Mapping, policy: str, budget: int, **settings) -> None:
        self.manager = make_manager(policy, budget=budget, num_blocks=64, mapping=mapping, num_layers=LAYERS,
                                    num_kv_heads=KV_HEADS, policy_options=OPTIONS.get(policy, {}), **settings)
        tp, tp_rank = mapping.tp_size, mapping.tp_rank
        self.layers = mapping.pp_layers(LAYERS)
        self.kv_heads = slice(tp_rank * KV_HEADS // tp, (tp_rank + 1) * KV_HEADS // tp)
        self.heads = slice(tp_rank * HEADS // tp, (tp_rank + 1) * HEADS // tp)
        self.perturb_at: int | None = None  # from this decode step on, this rank gets wrong queries

    def write_kv(self, model: Model, request) -> None:
        """The forward's KV write of the tokens this iteration added (the prompt, or one token)."""
        step, req_id = self.manager.vtoken.step, request.py_request_id
        if req_id in step:
            new = [(step.kv_len(req_id), step.num_tokens(req_id))]  # (physical position, logical id)
        else:
            new = [(t, t) for t in range(request.prompt_len)]
        blocks, pool = self.manager.get_cache_indices(request), self.manager.vtoken.step.executor.pools[0]
        for position, token in new:
            kv = model.kv(req_id, token)[self.layers][:, :, self.kv_heads]  # [local layers, 2, Hkv, D]
            pool[blocks[position // TPB], :, :, :, position % TPB] = kv.to(pool.dtype)

    def record(self, model: Model, batch: ScheduledRequests, step: int) -> None:
        """The patched attention forward of every layer this rank holds: prefill mass for the
        context rows, decode queries for the generation rows."""
        rows = batch.context_requests + batch.generation_requests
        num_contexts = len(batch.context_requests)
        lengths = [r.prompt_len for r in batch.context_requests] + [1] * len(batch.generation_requests)
        metadata = TrtllmAttentionMetadata(max_num_requests=4, kv_cache_manager=self.manager,
                                           request_ids=[r.py_request_id for r in rows], num_contexts=num_contexts,
                                           seq_lens=torch.tensor(lengths))
        heads, kv_heads = self.heads.stop - self.heads.start, self.kv_heads.stop - self.kv_heads.start
        for local, layer in enumerate(self.layers):
            q, k = [], []
            for i, request in enumerate(rows):
                req_id = request.py_request_id
                if i < num_contexts:
                    q.append(model.q(req_id, -1, request.prompt_len)[layer][:, self.heads])
                    k.append(torch.stack([model.kv(req_id, t)[layer, 0, self.kv_heads]
                                          for t in range(request.prompt_len)]))
                else:
                    wrong = self.perturb_at is not None and step >= self.perturb_at
                    q.append(model.q(req_id, step + (1000 if wrong else 0))[layer][:, self.heads])
                    k.append(torch.zeros(1, kv_heads, DIM))
            q, k = torch.cat(q).reshape(sum(lengths), -1), torch.cat(k).reshape(sum(lengths), -1)
            fused = torch.cat([q, k, torch.zeros_like(k)], dim=-1)
            record_queries(TrtllmAttention(layer, heads, DIM, kv_heads), fused, None, metadata)


def run_rank(rank: Rank, comm, model: Model, decode_steps: int) -> list[tuple[str, dict]]:
    """Prefill three prompts, then decode; after every iteration: (table digest, live tokens)."""
    utils_double.set_mpi_comm(comm)
    try:
        return _iterate(rank, model, decode_steps)
    finally:
        utils_double.set_mpi_comm(None)


def _iterate(rank: Rank, model: Model, decode_steps: int) -> list[tuple[str, dict]]:
    manager = rank.manager
    requests = [make_request(i, prompt_len=n, max_new_tokens=decode_steps + 1) for i, n in enumerate(PROMPTS)]
    history = []
    for step in range(decode_steps + 1):
        batch = ScheduledRequests(context_requests=requests) if step == 0 else \
            ScheduledRequests(generation_requests=requests)
        manager.prepare_resources(batch)
        for request in requests:
            rank.write_kv(model, request)
        rank.record(model, batch, step)
        manager.update_resources(batch)
        vstep = manager.vtoken.step
        history.append((vstep.table_digest(), {r.py_request_id: vstep.live_tokens(r.py_request_id).tolist()
                                               for r in requests}))
    return history


def run_ranks(layout: dict, policy: str, budget: int, decode_steps: int = 8, perturb: dict | None = None,
              reduce: bool = True, check: bool = True, **settings):
    world = layout.get("world_size", 1)
    comms = utils_double.ThreadCommDouble.world(world)
    model = Model(seed=7)

    def one(r: int):  # each rank builds its manager in its own thread, as each worker does
        utils_double.set_mpi_comm(comms[r])
        rank = Rank(Mapping(rank=r, **layout), policy, budget, **settings)
        rank.manager.vtoken_consistency.reduce = reduce and world > 1
        rank.perturb_at = (perturb or {}).get(r)
        if not check:  # to see where the tables part without being stopped there
            rank.manager.vtoken_consistency.check = lambda *args: None
        return run_rank(rank, comms[r], model, decode_steps)

    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(one, r) for r in range(world)]
        return [f.result() for f in futures]


LAYOUTS = {"tp2": dict(world_size=2, tp_size=2), "pp2": dict(world_size=2, pp_size=2),
           "tp2pp2": dict(world_size=4, tp_size=2, pp_size=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "random"])
def test_every_rank_decides_as_one_gpu_would(layout, policy):
    """Ranks holding different heads / layers: identical tables on every rank after every
    iteration (prefill included), equal to one manager holding the whole model, and evictions
    did happen."""
    single = run_ranks({}, policy, budget=BUDGET)[0]
    per_rank = run_ranks(LAYOUTS[layout], policy, budget=BUDGET)
    for history in per_rank:
        assert [live for _, live in history] == [live for _, live in single]
        assert [digest for digest, _ in history] == [digest for digest, _ in single]
    # evicted to the budget, a block at a time
    assert all(BUDGET - TPB < len(live) <= BUDGET for live in single[-1][1].values())


def test_without_the_reduction_each_tp_rank_scores_its_own_heads_and_the_check_fails():
    """The baseline the protocol prevents: no sum, so each rank's H2O sees only its heads; the
    digest check stops both ranks in the first iteration whose decisions differ."""
    with pytest.raises(RankDivergenceError, match=r"token tables diverged across ranks at step \d+"):
        run_ranks(LAYOUTS["tp2"], "h2o", budget=BUDGET, reduce=False)


def test_a_perturbed_rank_is_caught_in_the_step_it_diverges():
    """Two ranks holding the same heads (so that alone they would agree); rank 1 gets wrong
    queries from decode step 2 on. Without the reduction its decisions part from rank 0's at some step
    (found by a run without the check); with the check on, both ranks raise in exactly that step
    (steps count from 1, the prefill). With the reduction on, both ranks score the same sum and
    stay identical."""
    layout = LAYOUTS["tp2"]
    unchecked = _replicated(layout, perturb={1: 2}, reduce=False, check=False)
    differs = [i for i, (a, b) in enumerate(zip(*unchecked)) if a[0] != b[0]]
    assert differs, "the perturbation must change a decision for this test to mean anything"
    with pytest.raises(RankDivergenceError) as err:
        _replicated(layout, perturb={1: 2}, reduce=False)
    assert err.value.step == differs[0] + 1
    reduced = _replicated(layout, perturb={1: 2}, reduce=True)
    assert [d for d, _ in reduced[0]] == [d for d, _ in reduced[1]]


def _replicated(layout, perturb, reduce, check=True):
    """Both ranks hold the same heads (all of them), so without a perturbation they would agree
    with or without the reduction."""
    original = Rank.__init__

    def init(self, mapping, policy, budget, **settings):
        original(self, mapping, policy, budget, **settings)
        self.heads, self.kv_heads = slice(0, HEADS // 2), slice(0, KV_HEADS // 2)

    Rank.__init__ = init
    try:
        return run_ranks(layout, "h2o", budget=2 * BUDGET, decode_steps=20, perturb=perturb, reduce=reduce,
                         check=check)
    finally:
        Rank.__init__ = original


def test_the_cross_rank_sum_is_exact_and_the_same_bits_on_every_rank():
    """Floats added in a rank-dependent order (as the double's Allreduce does, like a reduction
    tree) can differ in the last bit per rank; the fixed-point sum cannot."""
    comms = utils_double.ThreadCommDouble.world(3)
    gen = np.random.default_rng(0)
    parts = [gen.random((4, 50)) * 10 for _ in range(3)]

    def one(r):
        floats = parts[r].copy()
        total = np.empty_like(floats)
        comms[r].Allreduce(floats, total)
        exact = MpiRanks(comms[r]).all_reduce_sum(torch.from_numpy(parts[r].copy()))
        return total, exact.numpy()

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, range(3)))
    assert any(not np.array_equal(results[0][0], other[0]) for other in results[1:])  # float order shows
    for _, exact in results[1:]:
        assert exact.tobytes() == results[0][1].tobytes()
    np.testing.assert_allclose(results[0][1], sum(parts), atol=3 / MASS_SCALE)


def test_a_mass_that_is_not_finite_saturates_alike_on_every_rank():
    """NaN and infinities have no fixed point: each rank saturates them alike (NaN and +inf to
    the largest addend, -inf to the smallest), so the sum is the same bits everywhere, ranks a
    NaN or +inf token above every real mass, and the step goes on (a refusal would stop it
    halfway). Finite positions sum as before."""
    comms = utils_double.ThreadCommDouble.world(3)
    gen = np.random.default_rng(1)
    parts = [gen.random((2, 6)) for _ in range(3)]
    parts[0][0, 1], parts[1][0, 2], parts[2][0, 3], parts[1][1, 4] = np.nan, np.inf, -np.inf, np.nan
    parts[2][1, 4] = -np.inf  # one rank NaN, another -inf: they cancel to a real mass

    def one(r):
        return MpiRanks(comms[r]).all_reduce_sum(torch.from_numpy(parts[r].copy())).numpy()

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, range(3)))
    for other in results[1:]:
        assert other.tobytes() == results[0].tobytes()
    total = results[0]
    assert np.isfinite(total).all()
    finite = np.isfinite(sum(parts))
    finite[1, 4] = False
    np.testing.assert_allclose(total[finite], sum(parts)[finite], atol=3 / MASS_SCALE)
    real_max = total[finite].max()
    assert total[0, 1] > 1e9 * real_max and total[0, 2] > 1e9 * real_max and total[0, 3] < -1e9 * real_max
    assert abs(total[1, 4]) < 3


@pytest.mark.parametrize("layout, message", [
    (dict(world_size=2, tp_size=2, enable_attention_dp=True), "attention data parallelism"),
    (dict(world_size=2, cp_size=2), "context parallelism"),
])
def test_layouts_beyond_tp_and_pp_are_refused(layout, message):
    with pytest.raises(ValueError, match=message):
        make_manager("streaming_llm", mapping=Mapping(**layout), num_layers=4)


def test_a_communicator_of_another_size_is_refused():
    utils_double.set_mpi_comm(None)  # a single-rank world, but the mapping says two ranks
    with pytest.raises(RuntimeError, match="MPI communicator has 1 ranks"):
        make_manager("h2o", mapping=Mapping(world_size=2, tp_size=2), num_layers=4)


def test_mpi_free_mode_is_refused_across_ranks(monkeypatch):
    monkeypatch.setenv("TLLM_DISABLE_MPI", "1")
    with pytest.raises(RuntimeError, match="TLLM_DISABLE_MPI=1"):
        make_manager("h2o", mapping=Mapping(world_size=2, pp_size=2), num_layers=4)
    make_manager("h2o", mapping=Mapping())  # one rank needs no communicator


@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_pipelined_batches_score_from_their_own_recordings(policy):
    """The pipeline-parallel executor (``PyExecutor._executor_loop_pp``) prepares and runs the
    forward of micro-batch N+1 before it calls ``update_resources(N)``; that forward overwrites the
    recorded queries. Each batch must still be scored from its own: the same decisions and
    accumulated statistics as when every batch is updated before the next is prepared."""

    def drive(pipelined: bool):
        rank, model = Rank(Mapping(), policy, BUDGET), Model(seed=3)
        manager = rank.manager
        groups = [[make_request(0, 14, 8)], [make_request(1, 9, 8), make_request(2, 11, 8)]]  # two micro-batches
        for step in range(6):
            batches = [ScheduledRequests(context_requests=g) if step == 0 else ScheduledRequests(generation_requests=g)
                       for g in groups]
            for batch in batches:
                manager.prepare_resources(batch)
                for request in batch.all_requests():
                    rank.write_kv(model, request)
                rank.record(model, batch, step)
                if not pipelined:
                    manager.update_resources(batch)
            if pipelined:
                for batch in batches:
                    manager.update_resources(batch)
        vstep = manager.vtoken.step
        stat = next(iter(vstep.policy.slot_stats))
        return {r: vstep.live_tokens(r).tolist() for r in range(3)}, \
            {r: vstep.token_stats(r, stat)[1].astype(np.float64) for r in range(3)}

    (live_seq, stats_seq), (live_pipe, stats_pipe) = drive(False), drive(True)
    assert live_pipe == live_seq
    for r in range(3):
        np.testing.assert_allclose(stats_pipe[r], stats_seq[r], rtol=1e-6)
