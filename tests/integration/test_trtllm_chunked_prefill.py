# SPDX-License-Identifier: Apache-2.0
"""Chunked prefill (``enable_chunked_prefill``) with VTokenKVCacheManager, through the 1.2.1
executor-loop double (``trtllm121``): the micro-batch scheduler cuts prompts into chunks of whole
blocks (``microBatchScheduler.cpp``), TensorRT-LLM allocates a prompt's blocks at its first chunk
(``add_sequence`` with the prompt's length; the capacity scheduler counts them then and nothing
for later chunks), the model engine starts each chunk's positions and cached count at
``context_current_position`` and vToken's metadata makes the cached count physical, so a chunk is
written after the compacted earlier ones. What the random mixes check (``KVWitness``) holds with
chunks; the overlap loop decides a prompt's chunks as the plain loop does; the prefill mass of a
later chunk is taken over the keys still held, with H2O's ``prefill_window`` counted from the
prompt's end.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.integration.test_trtllm_executor_loop import KVWitness, Mix, build_executor, drive, held_by_padding, \
    random_requests, trace_victims


@pytest.mark.parametrize("loop", ["plain", "overlap"])
@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "sliding_window", "random", "scissorhands"])
def test_chunked_prefill_through_the_executor_loop(trtllm121, policy, loop):
    """enable_chunked_prefill with 16 tokens an iteration: the micro-batch scheduler cuts prompts
    into chunks of whole blocks beside the decode rows (first-come-first-served, then equal
    progress), TensorRT-LLM allocates a prompt's blocks at its first chunk and vToken's step
    takes each chunk in after its forward, before the next chunk's (in the overlap loop too).
    Block reuse off for one mix (the prompt is evicted between chunks and the emptied blocks go
    back at once), on for the other (the prompt's full blocks are protected). Every check of the
    random mixes holds: block lists, density, every live token's K and V."""
    chunks = evicted_mid_prompt = 0
    for seed, (chunking, reuse) in ((1, ("FIRST_COME_FIRST_SERVED", False)), (2, ("EQUAL_PROGRESS", True))):
        mix = Mix(seed, num_requests=24, num_blocks=40 if loop == "plain" else 120)
        executor = build_executor(policy, mix, overlap=loop == "overlap", block_reuse=reuse, chunked=(16, chunking))
        manager = executor.resources["kv_cache_manager"]
        free_after_warmup = manager.get_num_free_blocks()
        schedule = executor.scheduler.schedule_request

        def count_chunks(*args, _schedule=schedule):
            nonlocal chunks
            out = _schedule(*args)
            chunks += sum(not r.is_last_context_chunk for r in out.context_requests)
            return out

        executor.scheduler.schedule_request = count_chunks
        release = manager._vtoken_release

        def count_mid_prompt(req_id, lost, _release=release, _manager=manager):
            nonlocal evicted_mid_prompt
            if _manager._vtoken_batches.reserved.get(req_id, 0) > _manager.vtoken.step.num_tokens(req_id):
                evicted_mid_prompt += 1
            _release(req_id, lost)

        manager._vtoken_release = count_mid_prompt
        requests = random_requests(mix)
        witness = KVWitness(executor, token_ahead=loop == "overlap" or None)
        drive(executor, requests, witness, overlap=loop == "overlap")
        assert all(executor.responses[r.py_request_id].finish_reason.name in ("END_ID", "LENGTH", "CANCELLED")
                   for r, _, _ in requests)
        assert not manager.vtoken.step.request_ids() and not manager._vtoken_held
        assert manager.get_num_free_blocks() == free_after_warmup - held_by_padding(executor)
        assert witness.checks > 500 and witness.ahead_seen > 0
    assert chunks > 20 and evicted_mid_prompt > 0


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "streaming_llm", "random"])
def test_prompt_chunks_decide_in_the_overlap_loop_as_in_the_plain_loop(trtllm121, policy):
    """Under _executor_loop_overlap a prompt's next chunk is scheduled while the forward of the
    one before is in flight; its batch's step is taken at prepare_resources of the next batch,
    before that forward, so each chunk is decided alone, with its own mass, as in the plain loop:
    every request's steps over its prompt's chunks but the last (tokens known, victims) are the
    same in both loops. (The last chunk's step, like a whole prompt's, runs there too where it may
    evict; where it cannot, it takes the next batch's token in with it under overlap, so its
    registration differs and it is not compared.) Three long prompts at once, 16 tokens an
    iteration, block reuse off."""
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig

    rng, traces = random.Random(5), {}
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (50, 37, 45)]
    for loop in ("plain", "overlap"):
        executor = build_executor(policy, Mix(0, num_blocks=120), overlap=loop == "overlap", block_reuse=False,
                                  chunked=(16, "FIRST_COME_FIRST_SERVED"))
        trace = trace_victims(executor.resources["kv_cache_manager"])
        for i, prompt in enumerate(prompts):
            executor.enqueue_request(LlmRequest(request_id=100 + i, max_new_tokens=8, input_tokens=prompt,
                                                sampling_config=SamplingConfig(1)))
        executor.run()
        traces[loop] = {r: [(n, v) for n, v in steps if n < len(prompts[r - 100])] for r, steps in trace.items()}
    assert traces["plain"] == traces["overlap"]
    assert all(len(steps) >= 2 for steps in traces["plain"].values())  # chunks of at most 16 tokens
    assert sum(len(v) for steps in traces["plain"].values() for _, v in steps) > 0  # evicted between chunks


@pytest.mark.parametrize("window", [None, 6])
def test_a_later_chunk_scores_the_keys_still_held_and_counts_the_window_from_the_prompt_end(trtllm121, window):
    """H2O over one 45-token prompt cut into chunks: each chunk's prefill pass (the forward hook)
    attends to the keys the table still holds (its cached count is the table's physical length,
    read through the request's block list) and its own; the row's mass reaches the step over
    exactly those positions. With ``prefill_window=6`` only the prompt's last 6 queries count:
    a chunk followed by 6 or more prompt tokens observes nothing, the last chunk its last
    6 - 0 queries."""
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig

    from trtllm_vtoken.integration.trtllm.scores import prefill_attention_mass

    options = {} if window is None else {"prefill_window": window}
    executor = build_executor("h2o", Mix(0, num_blocks=120), block_reuse=False, chunked=(16, "FIRST_COME_FIRST_SERVED"),
                              policy_options=options)
    manager = executor.resources["kv_cache_manager"]
    recorder, step = manager.vtoken_queries, manager.vtoken.step
    add_prefill, calls = recorder.add_prefill, []

    def checked(row, q, k, past_k=None, prompt_after=0):
        held = step.kv_len(100) if 100 in step else 0
        assert (0 if past_k is None else past_k.shape[0]) == held  # the earlier chunks' keys still held
        observed = None if window is None else max(0, window - prompt_after)
        want = prefill_attention_mass(q, k, past_k=past_k, window=observed)
        before = recorder.prefill.get(row)
        add_prefill(row, q, k, past_k, prompt_after)
        got = recorder.prefill[row] - (0 if before is None else before)
        assert got.shape[0] == held + q.shape[0] and torch.allclose(got, want, atol=1e-4)
        calls.append((held, q.shape[0], prompt_after, float(got.sum())))

    recorder.add_prefill = checked
    prompt = [random.Random(3).randrange(2, 500) for _ in range(45)]
    executor.enqueue_request(LlmRequest(request_id=100, max_new_tokens=4, input_tokens=prompt,
                                        sampling_config=SamplingConfig(1)))
    executor.run()
    layers = len(manager.pp_layers)
    chunks = [calls[i] for i in range(0, len(calls), layers)]
    assert [n for _, n, _, _ in chunks] == [16, 16, 13] and [a for _, _, a, _ in chunks] == [29, 13, 0]
    assert chunks[1][0] < 16 and chunks[2][0] < 32 - 4  # the first chunks were evicted down before the next
    if window is not None:  # nothing observed until the prompt's last 6 queries
        assert all(total == 0 for _, _, after, total in calls if after >= window)
        assert all(total > 0 for _, _, after, total in calls if after < window)


@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_a_decoding_request_decides_alike_beside_a_chunked_prompt(trtllm121, policy):
    """Under the overlap loop only the chunked prompt's own step is taken early: a request that
    decodes while another prompt is prefilled in chunks, in the same batches, takes every step
    (tokens known, victims) as it does alone."""
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig

    rng = random.Random(11)
    short, long = ([rng.randrange(2, 500) for _ in range(n)] for n in (14, 60))
    traces = {}
    for beside in (False, True):
        executor = build_executor(policy, Mix(0, num_blocks=120), overlap=True, block_reuse=False,
                                  chunked=(16, "FIRST_COME_FIRST_SERVED"))
        trace = trace_victims(executor.resources["kv_cache_manager"])
        executor.enqueue_request(LlmRequest(request_id=100, max_new_tokens=24, input_tokens=short,
                                            sampling_config=SamplingConfig(1)))
        if beside:  # arrives while the first decodes: its chunks share that request's batches
            executor.enqueue_request(LlmRequest(request_id=101, max_new_tokens=4, input_tokens=long,
                                                sampling_config=SamplingConfig(1)), 2)
        executor.run()
        traces[beside] = trace[100]
        if beside:
            assert len([n for n, _ in trace[101] if n < len(long)]) >= 3  # several chunks beside it
    assert traces[True] == traces[False] and any(v for _, v in traces[False])

