# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism on the real model: two gloo rank processes (SmolLM2-135M, fp32, its 3 KV
heads split 2 + 1) against one process holding the whole model.

One launch serves every check: for each variant and policy the two ranks run the same batch as a
single-process engine, and must produce the same greedy tokens, take every eviction decision the
single process takes, and end every step with equal token tables. Without the protocol (each rank
scoring from its own heads) the ranks diverge, and the table check stops them in that very step.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.consistency import RankDivergenceError
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.llm import LLM
from trtllm_vtoken.runtime.parallel.rank_process import Job
from trtllm_vtoken.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Write a haiku about the sea.", "Explain what a hash table is."]
PARAMS = SamplingParams(max_tokens=8)
# A budget well below the prompts (~37 tokens): every step evicts, and blocks of 4 free often. The
# chat template's system prompt is the same for both prompts: with prefix caching its shared blocks
# would be kept on top of the budget, so the decisions compared here run without caching.
BASE = dict(tokens_per_block=4, num_blocks=96, max_seq_len=96, budget=20, check_invariants=True,
            prefix_caching=False)
CASES = [
    dict(variant="native"),
    dict(variant="naive-evict", policy="h2o"),
    *(dict(variant="vtoken", mode=mode, policy=policy)
      for mode in ("dense", "lazy") for policy in ("h2o", "scissorhands", "streaming_llm", "random")),
]


def case_id(case: dict) -> str:
    return "-".join(str(v) for v in case.values())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The two ranks take one core each; the single-process reference runs meanwhile-idle, and
    with one thread (several threads on a shared 2-core machine spin against each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(smollm2_folder):
    with LLM(smollm2_folder, tensor_parallel_size=2, **BASE) as llm:
        yield llm


@pytest.fixture(scope="module")
def whole_model(smollm2_model):
    return smollm2_model


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(p, chat=True) for p in PROMPTS]


def run_one_process(model, tokenizer, config: EngineConfig, prompts):
    engine = Engine(model, config, tokenizer, record_trace=True)
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.requests[i] for i in ids]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_two_ranks_decide_as_one_process(llm, whole_model, smollm2_tokenizer, prompts, case):
    single = EngineConfig(**{**BASE, **case})
    expected = run_one_process(whole_model, smollm2_tokenizer, single, prompts)
    config = EngineConfig(**{**BASE, **case, "tensor_parallel_size": 2})
    reports = llm.ranks.run(Job(config, prompts, PARAMS, trace=True, logits=case["variant"] == "native"))

    for report in reports:
        for req_id, request in enumerate(expected):
            assert report.outputs[req_id] == request.output_ids  # greedy tokens, exactly
            assert report.evictions[req_id] == [tuple(e) for e in request.evictions]  # every decision
    # The ranks' tables, free blocks included, agree after every step (the engine also checked
    # it in each step: check_invariants).
    assert reports[0].digests == reports[1].digests and len(reports[0].digests) == PARAMS.max_tokens
    if case["variant"] != "native":
        assert sum(len(e) for e in reports[0].evictions[0]) > 0
    if case.get("policy") in ("h2o", "scissorhands"):
        protocol = reports[0].protocol
        assert protocol.reductions > 0  # the mass was summed over the ranks, every forward,
        assert protocol.carried == protocol.reductions  # inside the last o_proj all-reduce
    else:
        assert reports[0].protocol.reductions == 0  # nothing to reduce: rank-independent inputs
    if case["variant"] == "native":  # the reduction order differs, so logits differ in the last bits only
        for req_id, request in enumerate(expected):
            torch.testing.assert_close(torch.stack(reports[0].logits[req_id]), torch.stack(request.logits),
                                       rtol=0, atol=1e-3)


def test_without_the_protocol_ranks_diverge_and_the_check_stops_them_that_step(llm, prompts):
    """Each rank scores from its own heads only (2 KV heads vs 1): their H2O victims differ at some
    step; the table check raises in that same step, on both ranks, before anything else runs.
    Decode steps lagged, so an iteration checks one step at most, as counted below (deciding at
    once, an iteration may check two: the deferred rows' and those that may evict)."""
    config = EngineConfig(**{**BASE, "variant": "vtoken", "policy": "h2o", "tensor_parallel_size": 2,
                             "reduce_attention_mass": False, "decode_decision": "lagged"})
    with pytest.raises(RankDivergenceError) as caught:
        llm.ranks.run(Job(config, prompts, PARAMS, trace=True))
    step, reports = caught.value.step, caught.value.reports
    first_difference = min(
        k for req_id in reports[0].evictions
        for k, (a, b) in enumerate(zip(reports[0].evictions[req_id], reports[1].evictions[req_id])) if a != b)
    assert step == first_difference
    # One digest per iteration, equal before it: the overlap scheduler's first iteration runs no
    # step, so the iteration that raised at step k was the (k + 2)-th.
    assert reports[0].digests == reports[1].digests and len(reports[0].digests) == step + 1


def test_llm_generate_and_stream_at_tp2_match_one_process(llm, whole_model, smollm2_tokenizer, prompts):
    expected = run_one_process(whole_model, smollm2_tokenizer, EngineConfig(**BASE), prompts)
    outputs = llm.generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in outputs] == [r.output_ids for r in expected]
    assert [o.outputs[0].text for o in outputs] == [r.text for r in expected]
    assert [(o.prompt, o.prompt_token_ids, o.finished) for o in outputs] == list(zip(PROMPTS, prompts, [True] * 2))
    # Alone, the first prompt shares its blocks with no one: it evicts as a request alone does.
    alone = run_one_process(whole_model, smollm2_tokenizer, EngineConfig(**BASE), prompts[:1])
    snapshots = list(llm.stream(PROMPTS[0], PARAMS))
    assert "".join(s.outputs[0].text_diff for s in snapshots) == alone[0].text
    assert snapshots[-1].outputs[0].token_ids == alone[0].output_ids and snapshots[-1].finished
    assert llm.last_reports[0].tokens_evicted > 0


def test_the_benchmark_probe_runs_on_every_rank(llm):
    from trtllm_vtoken.bench.tp import time_collectives

    probes = llm.ranks.call(time_collectives, 2, 576, 40, 2, 3)
    assert len(probes) == 2 and all(v > 0 for p in probes for v in p.values())
