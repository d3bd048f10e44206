# SPDX-License-Identifier: Apache-2.0
"""NGram speculative decoding with VTokenKVCacheManager, through the 1.2.1 executor-loop double
(``trtllm121``; the drafter in ``_torch/speculative/ngram.py``, the draft handling of the loop,
the model engine, the sampler and the KV-cache manager each cite their source).

Per iteration TensorRT-LLM gives every decode row ``max_draft_len`` placeholder drafts before
scheduling, allocates KV for the token and its drafts (``add_token`` each), lets the drafter fill
them from its n-gram pool (padded to the maximum), runs the row's token and drafts in one forward,
accepts the drafts the target agrees with, and rewinds the rejected ones' KV in
``update_resources`` before vToken's step. The mixes: prompts of random tokens; two requests in
three continue by copying their own text (so the pool's drafts are often right), the third by a
pseudo-random choice (so they are wrong). NGram turns the overlap scheduler off (the executor
creator), so the plain loop runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_trtllm_executor_loop import KVWitness, Mix, build_executor, drive, held_by_padding, \
    random_requests, trace_victims

SPEC = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}


def copying_token(request) -> int:
    """The double's model: most requests repeat their text with a period of 5 to 8 tokens (drafts
    from the pool hit); every third one picks a pseudo-random token (drafts miss)."""
    tokens = request.get_tokens(0)
    if request.py_request_id % 3 == 0 or len(tokens) < 9:
        return (request.py_request_id * 7919 + len(tokens) * 104729) % 500 + 2
    return tokens[-(5 + request.py_request_id % 4)]


def build(policy: str, mix: Mix, monkeypatch, chunked: tuple[int, str] | None = None):
    from tensorrt_llm._torch.pyexecutor import _util

    monkeypatch.setattr(_util, "greedy_token", copying_token)
    return build_executor(policy, mix, overlap=True, speculative_config=SPEC, chunked=chunked)


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "sliding_window", "random", "scissorhands"])
def test_ngram_drafting_through_the_executor_loop(trtllm121, policy, monkeypatch):
    """Every check of the random mixes holds with drafts (block lists, density, every live
    token's K and V after each update); after each update every table knows exactly the
    request's tokens but the last sampled one (the row's token and its accepted drafts, never a
    rejected draft); drafts were both accepted and rewound; the pool's blocks all come back. CUDA
    graphs are on (TensorRT-LLM's default): decode batches are padded with a dummy carrying drafts
    too. The second mix also prefills its prompts in chunks (32 tokens an iteration, drafts included)
    beside the drafts."""
    accepted = rewound = 0
    for seed, chunked in ((1, None), (2, (32, "FIRST_COME_FIRST_SERVED"))):
        mix = Mix(seed, num_requests=24, num_blocks=60)
        executor = build(policy, mix, monkeypatch, chunked)
        assert executor.event_loop.__name__ == "_executor_loop"  # NGram: the creator turned overlap off
        assert executor.resource_manager.get_resource_manager("spec_resource_manager") is not None
        manager = executor.resources["kv_cache_manager"]
        free_after_warmup = manager.get_num_free_blocks()
        witness = KVWitness(executor)
        update, step = executor.resource_manager.update_resources, manager.vtoken.step

        def update_then_check(batch, *args, _update=update):
            nonlocal accepted, rewound
            for req in batch.generation_requests:
                accepted += req.py_num_accepted_draft_tokens
                rewound += req.py_rewind_len
            _update(batch, *args)
            for req in executor.active_requests:
                if req.py_request_id in step and not req.is_context_init_state():
                    assert step.num_tokens(req.py_request_id) == req.get_num_tokens(0) - 1, req.py_request_id

        executor.resource_manager.update_resources = update_then_check
        requests = random_requests(mix)
        drive(executor, requests, witness)
        assert all(executor.responses[r.py_request_id].finish_reason.name in ("END_ID", "LENGTH", "CANCELLED")
                   for r, _, _ in requests)
        # the CUDA-graph padding dummy (with its drafts) keeps its blocks
        assert not step.request_ids() and manager.get_num_free_blocks() == free_after_warmup - held_by_padding(executor)
        assert witness.checks > 500 and step.stats.tokens_evicted > 0
    assert accepted > 50 and rewound > 50


def test_a_decode_rows_mass_counts_its_token_and_accepted_drafts_only(trtllm121, monkeypatch):
    """H2O: the mass a decode row with drafts brings to the step is, per position, the sum over
    its token's and its accepted drafts' queries of each one's softmax over the positions it
    attended (the specification, ``scores.batch_decode_attention_mass``, one query at a time);
    the rejected drafts' queries add nothing."""
    from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass

    mix = Mix(3, num_requests=12, num_blocks=60)
    executor = build("h2o", mix, monkeypatch)
    manager = executor.resources["kv_cache_manager"]
    step, device_mass, checked = manager.vtoken.step, manager._vtoken_device_mass, []
    requests = {}

    def checked_mass(rows, prepared, width):
        out = device_mass(rows, prepared, width)
        by_id = {r.py_request_id: r for r in prepared.batch.generation_requests}
        pool = step.executor.pools[0]
        for i, (req_id, kv_len, blocks) in enumerate(rows):
            req = by_id.get(req_id)
            if req is None or not req.py_draft_tokens:
                continue
            kind, queries = manager._vtoken_batches.recording(prepared, req_id)
            counted = 1 + req.py_num_accepted_draft_tokens
            assert kv_len - step.kv_len(req_id) == counted
            want = torch.zeros(kv_len)
            for j in range(counted):  # query j attended the positions before its own, and its own
                mass = batch_decode_attention_mass(queries[j][None], pool, [blocks], [kv_len - counted + 1 + j])[0]
                want[: mass.shape[0]] += mass
            torch.testing.assert_close(out[i, : want.shape[0]], want, rtol=1e-4, atol=1e-5)
            assert not out[i, want.shape[0]:].any()
            checked.append(counted)
        return out

    manager._vtoken_device_mass = checked_mass
    for req, arrival, _ in random_requests(mix):
        requests[req.py_request_id] = req
        executor.enqueue_request(req, arrival)
    executor.run()
    assert len(checked) > 30 and max(checked) > 1 and min(checked) == 1  # some drafts accepted, some not


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])
def test_with_a_private_pool_a_request_decides_alike_alone_and_beside_another(trtllm121, policy, monkeypatch):
    """``is_public_pool=False``: a request's drafts come from its own text only, so its
    acceptance, and the steps (tokens known, victims) its policy takes, are the same alone and
    beside another request repeating the same text."""
    from tensorrt_llm._torch.pyexecutor import _util
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig

    monkeypatch.setattr(_util, "greedy_token", copying_token)
    prompt = [7, 8, 9, 10, 11, 12, 13, 7, 8, 9, 10, 11, 12, 13]
    traces = {}
    for beside in (False, True):
        executor = build_executor(policy, Mix(0, num_blocks=120), block_reuse=False,
                                  speculative_config={**SPEC, "is_public_pool": False})
        trace = trace_victims(executor.resources["kv_cache_manager"])
        executor.enqueue_request(LlmRequest(request_id=101, max_new_tokens=30, input_tokens=prompt,
                                            sampling_config=SamplingConfig(1)))
        if beside:
            executor.enqueue_request(LlmRequest(request_id=102, max_new_tokens=30, input_tokens=prompt[::-1],
                                                sampling_config=SamplingConfig(1)), 1)
        executor.run()
        traces[beside] = trace[101]
    assert traces[True] == traces[False] and any(v for _, v in traces[False])
    assert any(n2 - n1 > 1 for (n1, _), (n2, _) in zip(traces[False], traces[False][1:]))  # drafts accepted



@pytest.mark.parametrize("sm_version", ["90", "100"])
def test_the_recorder_holds_each_decode_rows_queries_whichever_rows_run_as_context(trtllm121, sm_version,
                                                                                    monkeypatch):
    """Where the spec mode's ``extend_ctx`` holds (``speculative/interface.py``: Hopper under one
    build's rule, Ampere under every one; SM 90 here), the model engine counts the rows with drafts
    among ``num_contexts`` and runs them as chunked context rows (``num_chunked_ctx_requests`` of
    them). After every forward the recorder must still hold, for each decode row, its token's and
    its drafts' queries exactly as the kernel got them, and a prefill mass for the prompts' rows
    only."""
    monkeypatch.setenv("TLLM_DOUBLE_SM_VERSION", sm_version)
    executor = build("h2o", Mix(4, num_requests=10, num_blocks=60), monkeypatch)
    engine, manager = executor.model_engine, executor.resources["kv_cache_manager"]
    forward, seen = engine.forward, {"rows": 0, "extended": 0}

    def forward_then_compare(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs)
        metadata, prepared = engine.attn_metadata, manager._vtoken_batches.latest()
        lens = metadata.seq_lens.tolist()
        generating = {r.py_request_id for r in batch.generation_requests}
        assert set(manager.vtoken_queries.prefill) <= set(range(len(batch.context_requests)))
        for row, req_id in enumerate(metadata.request_ids):
            if req_id not in generating:
                continue
            kind, queries = manager._vtoken_batches.recording(prepared, req_id)
            assert kind == "decode" and queries.shape[0] == lens[row]
            start = sum(lens[:row])
            for layer in engine.model.layers:
                kernel = layer.attn.rotated_q[start : start + lens[row]]
                assert torch.equal(queries[:, manager.local_layer(layer.layer_idx)], kernel), (req_id, row)
            seen["rows"] += 1
        seen["extended"] += metadata.num_chunked_ctx_requests
        return out

    engine.forward = forward_then_compare
    for req, arrival, _ in random_requests(Mix(4, num_requests=10, num_blocks=60)):
        executor.enqueue_request(req, arrival)
    executor.run()
    assert seen["rows"] > 30
    assert (seen["extended"] > 0) == (sm_version == "90")


def test_prompt_rows_reads_the_rows_run_as_context_and_refuses_an_impossible_count():
    from types import SimpleNamespace

    from trtllm_vtoken.integration.trtllm.patches import prompt_rows

    assert prompt_rows(SimpleNamespace(num_contexts=3)) == 3  # builds without the field
    assert prompt_rows(SimpleNamespace(num_contexts=3, num_chunked_ctx_requests=2)) == 1
    with pytest.raises(RuntimeError, match="2 decode rows among its 1 context rows"):
        prompt_rows(SimpleNamespace(num_contexts=1, num_chunked_ctx_requests=2))


def test_decode_rows_with_drafts_are_read_before_those_without(trtllm121):
    """The model engine's rows: context rows, then the generation rows with draft tokens, then
    those without (``_prepare_tp_inputs``); a batch mixing them is read in that order."""
    from tests.integration.trtllm_doubles import ScheduledRequests, make_request
    from trtllm_vtoken.integration.trtllm.batches import PreparedBatch

    plain, drafted, prompt = make_request(1, 5, 4), make_request(2, 5, 4), make_request(3, 5, 4)
    plain.py_draft_tokens, drafted.py_draft_tokens = [], [7, 8]
    batch = ScheduledRequests(context_requests=[prompt], generation_requests=[plain, drafted])
    rows = PreparedBatch(batch, through={}, prompt_after={}).recording_rows()
    assert rows == {3: ("prefill", 0, 0), 2: ("decode", 0, 3), 1: ("decode", 3, 4)}
