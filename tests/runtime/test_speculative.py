# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding with n-gram drafts (``EngineConfig.speculative_config``): the drafts are
verified in one forward, the rejected ones dropped before the step takes the iteration in. Greedy
output equals one token at a time (penalties and stop tokens included); every policy's vtoken
(dense, lazy) equals naive-evict decision for decision with drafting, rejections included. The
tiny model's weights are scaled up so that its greedy text varies (the plain one repeats a token)."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.drafting import NGramDecodingConfig, ngram_drafts
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

SPEC = {"max_draft_len": 3, "max_matching_ngram_size": 2}
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def test_ngram_drafts_follow_the_latest_earlier_occurrence():
    cfg = NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2)
    assert ngram_drafts([1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2], cfg, 10) == [5, 6, 1]  # "1 2" last seen before "5 6"
    assert ngram_drafts([7, 8, 9, 8], cfg, 10) == [9, 8]  # no bigram match: the unigram "8"
    assert ngram_drafts([1, 2, 3], cfg, 10) == []
    assert ngram_drafts([5, 6, 5, 6, 5], cfg, 1) == [6]  # at most the room left
    assert NGramDecodingConfig.of({"decoding_type": "NGram", "max_draft_len": 2}).max_draft_len == 2
    with pytest.raises(ValueError, match="only 'NGram'"):
        NGramDecodingConfig.of({"decoding_type": "Eagle3"})
    with pytest.raises(ValueError, match="unknown"):
        NGramDecodingConfig.of({"max_draft_len": 2, "is_keep_all": True})
    with pytest.warns(UserWarning, match="turns the overlap scheduler off"):  # as TensorRT-LLM does for NGram
        assert not EngineConfig(speculative_config=SPEC).overlap_scheduler



@pytest.fixture(scope="module")
def model(sharp_tiny_model) -> LlamaForCausalLM:
    return sharp_tiny_model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 128, (10,), generator=g).tolist()
    return [(base + torch.randint(0, 128, (n,), generator=g).tolist()) * 2 for n in (3, 9, 1, 6)]


def run(model, params=PARAMS, **overrides):
    values = dict(tokens_per_block=4, num_blocks=200, max_batch_size=4, max_seq_len=80, check_invariants=True,
                  overlap_scheduler=False)
    values.update(overrides)
    engine = Engine(model, EngineConfig(**values), record_trace=True)
    ids = [engine.add_request(p, params, req_id=i) for i, p in enumerate(prompts())]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    assert engine.kv.num_available == engine.kv.pool.num_blocks  # rejected drafts' blocks came back
    return [engine.pop_finished(i) for i in ids], engine


@pytest.mark.parametrize("params", [PARAMS, SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.5)],
                         ids=["greedy", "penalised"])
def test_greedy_output_equals_one_token_at_a_time(model, params):
    plain, one_by_one = run(model, params, variant="native")
    drafted, engine = run(model, params, variant="native", speculative_config=SPEC)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    stats = engine.speculation.stats
    assert stats.drafted > stats.accepted > 0  # both paths: drafts kept, drafts dropped
    assert engine.stats.steps <= one_by_one.stats.steps  # accepted drafts save steps (the batch ends with its last)


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there(model):
    plain, _ = run(model, variant="native")
    stop = plain[0].output_ids[5]
    params = SamplingParams(max_tokens=24, stop_token_ids=[stop])
    want, _ = run(model, params, variant="native")
    got, _ = run(model, params, variant="native", speculative_config=SPEC)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert got[0].output_ids[-1] == stop and got[0].finish_reason == "stop"


def test_sampled_requests_draft_nothing(model):
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=1)
    _, engine = run(model, params, variant="native", speculative_config=SPEC)
    assert engine.speculation.stats.drafted == 0


@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
def test_vtoken_equals_naive_evict_with_drafting(model, policy):
    reference = None
    for variant, mode in (("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy")):
        out, engine = run(model, variant=variant, mode=mode, policy=policy, budget=16, speculative_config=SPEC,
                          policy_options={"n_sink": 2} if policy == "streaming_llm" else {})
        reference = reference or out
        for a, b in zip(reference, out):
            assert a.evictions == b.evictions and a.output_ids == b.output_ids, f"{variant} {mode}: {a.req_id}"
        assert engine.speculation.stats.drafted > engine.speculation.stats.accepted
    assert any(any(r.evictions) for r in reference)


CHUNKED = dict(enable_chunked_prefill=True, max_num_tokens=12, prefix_caching=False, lazy_background=False)


@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
def test_drafting_beside_chunked_prefill_keeps_outputs_and_the_iterations_tokens(model, policy):
    """Prompts of 22-38 tokens prefilled in chunks of 8 beside decode rows with drafts: a decode
    row's drafts count in ``max_num_tokens`` before the prompts' chunks (as TensorRT-LLM's
    micro-batch scheduler counts them), so no iteration computes more than 12 tokens; greedy
    output is native's one token at a time; vtoken dense and lazy equal naive-evict."""
    options = {"n_sink": 2} if policy == "streaming_llm" else {}
    plain, _ = run(model, variant="native", **CHUNKED)
    reference = None
    for variant, mode in (("native", "dense"), ("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy")):
        computed: list[int] = []
        values = dict(tokens_per_block=4, num_blocks=200, max_batch_size=4, max_seq_len=80, check_invariants=True,
                      overlap_scheduler=False, variant=variant, mode=mode, policy=policy, budget=16,
                      policy_options=options, speculative_config=SPEC, **CHUNKED)
        engine = Engine(model, EngineConfig(**values), record_trace=True)
        forward = engine.forwards.run
        engine.forwards.run = lambda ids, tokens, *a, _run=forward, **k: (computed.append(sum(map(len, tokens))),
                                                                           _run(ids, tokens, *a, **k))[1]
        ids = [engine.add_request(p, PARAMS, req_id=i) for i, p in enumerate(prompts())]
        per_step = []
        while engine.has_unfinished():
            computed.clear()
            engine.step()
            per_step.append(sum(computed))
        out = [engine.pop_finished(i) for i in ids]
        assert max(per_step) <= 12 and engine.speculation.stats.drafted > engine.speculation.stats.accepted > 0
        if variant == "native":
            assert [r.output_ids for r in out] == [r.output_ids for r in plain]
            continue
        reference = reference or out
        for a, b in zip(reference, out):
            assert a.evictions == b.evictions and a.output_ids == b.output_ids, f"{variant} {mode}: {a.req_id}"
    assert any(any(r.evictions) for r in reference)


@pytest.mark.slow
def test_smollm2_drafts_change_no_greedy_token(smollm2_model, smollm2_tokenizer):
    """SmolLM2 repeating a source from its prompt: n-gram drafts are accepted and rejected, the
    greedy output is the one of decoding a token at a time, and vtoken equals naive-evict with
    drafting (``vtoken bench spec`` measures the same at more tokens)."""
    from trtllm_vtoken.bench.spec import SpecBenchConfig, prompts as repeat_prompts
    real = smollm2_model
    batch = repeat_prompts(SpecBenchConfig(requests=2, source_tokens=64), smollm2_tokenizer)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def serve(**settings):
        engine = Engine(real, EngineConfig(num_blocks=64, max_batch_size=2, overlap_scheduler=False, policy="h2o",
                                           budget=0.5, **settings), smollm2_tokenizer, record_trace=True)
        ids = [engine.add_request(p, params) for p in batch]
        while engine.has_unfinished():
            engine.step()
        return [engine.pop_finished(i) for i in ids], engine

    plain, _ = serve(variant="native")
    drafted, engine = serve(variant="native", speculative_config=SPEC)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    assert engine.speculation.stats.drafted > engine.speculation.stats.accepted > 0
    naive, _ = serve(variant="naive-evict", speculative_config=SPEC)
    vtoken, _ = serve(variant="vtoken", speculative_config=SPEC, check_invariants=True)
    for a, b in zip(naive, vtoken):
        assert a.evictions == b.evictions and a.output_ids == b.output_ids


@pytest.mark.parametrize("policy", ["scissorhands", "h2o", "streaming_llm"])
def test_a_requests_drafts_and_answer_do_not_depend_on_the_batch(model, policy):
    """With eviction, a step taking 1 + a tokens decides elsewhere than one taking 1, so how far a
    request drafts must not depend on what runs beside it: each decode row drafts at most its
    share of ``max_num_tokens`` (``draft_tokens_per_row``: 2 here, of ``max_draft_len`` 3), and
    admission counts a step's drafts in its blocks, so a tight pool never takes them away. Each
    request alone and in the batch (prompts prefilled in chunks of 8): the same decisions and
    tokens."""
    options = {"n_sink": 2} if policy == "streaming_llm" else {}
    values = dict(tokens_per_block=4, num_blocks=40, max_batch_size=4, max_seq_len=80, overlap_scheduler=False,
                  policy=policy, budget=12, policy_options=options, speculative_config=SPEC, **CHUNKED)
    assert EngineConfig(**values).draft_tokens_per_row == 2
    engine = Engine(model, EngineConfig(**values), record_trace=True)
    draft, rows = engine.speculation.draft, 0

    def draft_then_check(decode):
        nonlocal rows
        drafts = draft(decode)
        for req_id in decode:  # what the row proposes on its own, whatever else runs
            request = engine.requests[req_id]
            alone = ngram_drafts(request.prompt_ids + request.output_ids, engine.config.speculative_config,
                                 min(request.remaining - 1, 2))
            assert drafts.get(req_id, []) == alone, req_id
            rows += bool(alone)
        return drafts

    engine.speculation.draft = draft_then_check
    ids = [engine.add_request(p, PARAMS, req_id=i) for i, p in enumerate(prompts())]
    while engine.has_unfinished():
        engine.step()
    together = [engine.pop_finished(i) for i in ids]
    assert rows > 10 and any(any(r.evictions) for r in together)
    for i, prompt in enumerate(prompts()):
        alone = Engine(model, EngineConfig(**values), record_trace=True)
        alone.add_request(prompt, PARAMS, req_id=i)
        while alone.has_unfinished():
            alone.step()
        got = alone.pop_finished(i)
        assert got.output_ids == together[i].output_ids and got.evictions == together[i].evictions, i


def test_a_request_the_pool_holds_only_without_drafts_runs_without_them(model):
    """Admission counts a decode step's drafts in a request's blocks; a request that fits the pool
    alone only without them is still taken, and never drafts (fixed when it is added: nothing
    else running decides it). Sampled requests draft nothing and are counted without drafts."""
    values = dict(tokens_per_block=4, num_blocks=3, max_batch_size=4, max_seq_len=80, overlap_scheduler=False,
                  policy="sliding_window", budget=8, speculative_config={"max_draft_len": 4})
    engine = Engine(model, EngineConfig(**values))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    req_id = engine.add_request([3, 4, 5, 6, 3, 4, 5, 6], params)
    assert engine.requests[req_id].draft_tokens == 0
    roomy = Engine(model, EngineConfig(**{**values, "num_blocks": 8}))
    assert roomy.requests[roomy.add_request([3, 4, 5, 6, 3, 4, 5, 6], params)].draft_tokens == 4
    sampled = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=1)
    assert roomy.requests[roomy.add_request([3, 4, 5, 6], sampled)].draft_tokens == 0
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_finished(req_id).output_ids) == 20 and engine.speculation.stats.drafted == 0


@pytest.mark.parametrize("mode", ["dense", "lazy"])
def test_vtoken_drafts_in_every_pool_where_naive_evict_drafts(model, mode):
    """A request's drafts are fixed when it is added, from its peak blocks alone: vToken's peak
    never exceeds naive-evict's, so in no pool does naive-evict draft and vToken not (lazy mode's
    fragmentation threshold once made it draft nothing there, and decide at other steps)."""
    values = dict(policy="streaming_llm", policy_options={"n_sink": 2}, budget=8, eviction_unit=4, tokens_per_block=4,
                  max_seq_len=96, prefix_caching=False, overlap_scheduler=False, speculative_config={"max_draft_len": 4,
                                                                            "max_matching_ngram_size": 2})
    prompt, params = [(i * 37) % 128 for i in range(18)], SamplingParams(max_tokens=3, ignore_eos=True)

    def drafts(variant: str, num_blocks: int) -> int | None:
        engine = Engine(model, EngineConfig(variant=variant, mode="dense" if variant != "vtoken" else mode,
                                            num_blocks=num_blocks, **values))
        try:
            return engine.requests[engine.add_request(prompt, params)].draft_tokens
        except ValueError:  # the pool cannot hold it at all
            return None

    for num_blocks in range(1, 12):
        naive = drafts("naive-evict", num_blocks)
        if naive is not None:
            assert drafts("vtoken", num_blocks) >= naive, num_blocks
    traces = []
    for variant in ("naive-evict", "vtoken"):  # the smallest pool where naive-evict drafts 4
        pool = next(n for n in range(1, 12) if drafts("naive-evict", n) == 4)
        engine = Engine(model, EngineConfig(variant=variant, mode="dense" if variant != "vtoken" else mode,
                                            num_blocks=pool, check_invariants=True, **values), record_trace=True)
        req_id = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        done = engine.pop_finished(req_id)
        traces.append((done.draft_tokens, done.output_ids, done.evictions))
    assert traces[0] == traces[1] and traces[0][0] == 4 and any(traces[0][2])


def test_a_token_limit_leaving_no_draft_per_row_is_said():
    with pytest.warns(UserWarning, match=r"drafts nothing: max_num_tokens \(12\) leaves no draft token per row"):
        config = EngineConfig(max_num_tokens=12, max_batch_size=8, speculative_config=SPEC, overlap_scheduler=False)
    assert config.draft_tokens_per_row == 0
    assert EngineConfig(max_num_tokens=40, max_batch_size=8, speculative_config=SPEC,
                        overlap_scheduler=False).draft_tokens_per_row == 3  # (40 - 8) // 8, at most max_draft_len
