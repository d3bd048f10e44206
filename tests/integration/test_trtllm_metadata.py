# SPDX-License-Identifier: Apache-2.0
"""VTokenAttentionMetadata over the 1.2.1 ``TrtllmAttentionMetadata`` double: the KV length the
kernels see becomes physical, a second ``prepare()`` of the same step changes nothing, and the
context lengths given to the op never exceed what is physically held (prompt tokens evicted)."""

from __future__ import annotations

import torch

from tests.integration.test_trtllm_adapter import make_manager, write_new_kv
from tests.integration.trtllm_doubles import (
    KVCacheParams,
    ScheduledRequests,
    TrtllmAttentionMetadata,
    make_request,
)
from trtllm_vtoken.integration.trtllm.metadata import build_metadata_class

PROMPTS = (10, 13)


def decoded_manager(steps: int = 6):
    """Two requests prefilled and decoded ``steps`` times under a sliding window of 8: prompt
    tokens are evicted and compacted away."""
    manager, gen = make_manager("sliding_window", budget=8), torch.Generator().manual_seed(7)
    requests = [make_request(req, prompt_len=n, max_new_tokens=20) for req, n in enumerate(PROMPTS)]
    prefill = ScheduledRequests(context_requests=requests)
    manager.prepare_resources(prefill)
    for request in requests:
        write_new_kv(manager, request, gen)
    manager.update_resources(prefill)
    for _ in range(steps):
        batch = ScheduledRequests(generation_requests=requests)
        manager.prepare_resources(batch)
        for request in requests:
            write_new_kv(manager, request, gen)
        manager.update_resources(batch)
    manager.prepare_resources(ScheduledRequests(generation_requests=requests))  # the step being prepared
    return manager, requests


def metadata_for(manager, requests, cls=None):
    """What the model engine hands over for a generation step: logical lengths (the tokens before
    this one, all the step knows of), a fresh params."""
    step = manager.vtoken.step
    cls = cls or build_metadata_class(TrtllmAttentionMetadata)
    return cls(max_num_requests=4, kv_cache_manager=manager, request_ids=[r.py_request_id for r in requests],
               prompt_lens=[r.prompt_len for r in requests], num_contexts=0, seq_lens=torch.tensor([1, 1]),
               kv_cache_params=KVCacheParams(use_cache=True, num_cached_tokens_per_seq=[
                   step.num_tokens(r.py_request_id) for r in requests]))


def test_prepare_twice_is_prepare_once():
    manager, requests = decoded_manager()
    step = manager.vtoken.step
    physical = [step.kv_len(r.py_request_id) + 1 for r in requests]  # with the token being decoded
    assert all(manager.vtoken_evicted(r.py_request_id) > 0 for r in requests)
    metadata = metadata_for(manager, requests)
    for _ in range(3):  # e.g. a graph's warm-up and the step itself, on the same params
        metadata.prepare()
        assert metadata.kv_lens[:2].tolist() == physical
        assert metadata.kv_cache_params.num_cached_tokens_per_seq == [n - 1 for n in physical]
    # The next step brings new params with logical values: made physical afresh.
    fresh = metadata_for(manager, requests)
    metadata.kv_cache_params = fresh.kv_cache_params
    metadata.prepare()
    assert metadata.kv_lens[:2].tolist() == physical


def test_context_lengths_given_to_the_op_never_exceed_what_is_held():
    """The op gets prompt_lens as context_lengths (``prompt_lens_cpu/_cuda``). With prompt tokens
    evicted, the logical prompt length exceeds the physical KV length; vToken hands over the
    prompt tokens still held, as RocketKV's metadata does after its own prompt eviction."""
    manager, requests = decoded_manager()
    metadata = metadata_for(manager, requests)
    metadata.prepare()
    step = manager.vtoken.step

    def prompt_tokens_held(request):
        tokens = step.batch_tokens([request.py_request_id])[0]  # live id per physical position, -1: none
        return int(((tokens >= 0) & (tokens < request.prompt_len)).sum())

    for row, request in enumerate(requests):
        req = request.py_request_id
        held = prompt_tokens_held(request)
        assert request.prompt_len > step.kv_len(req) + 1  # the logical value would exceed kv_len
        assert metadata.prompt_lens_cpu_runtime[row].item() == held == metadata.prompt_lens_cuda_runtime[row].item()
        assert held <= metadata.kv_lens[row].item() - 1  # within the past the kernel reads
    assert metadata.prompt_lens == list(PROMPTS)  # the logical list is left as given
    metadata.prepare()  # idempotent here too
    assert metadata.prompt_lens_cpu_runtime.tolist() == [prompt_tokens_held(r) for r in requests]


def test_context_rows_and_requests_without_evictions_keep_their_lengths():
    manager = make_manager("sliding_window", budget=64)
    requests = [make_request(0, prompt_len=6, max_new_tokens=4)]
    prefill = ScheduledRequests(context_requests=requests)
    manager.prepare_resources(prefill)
    metadata = build_metadata_class(TrtllmAttentionMetadata)(
        max_num_requests=2, kv_cache_manager=manager, request_ids=[0], prompt_lens=[6], num_contexts=1,
        seq_lens=torch.tensor([6]), kv_cache_params=KVCacheParams(use_cache=True, num_cached_tokens_per_seq=[0]))
    metadata.prepare()
    assert metadata.kv_lens[0].item() == 6 and metadata.prompt_lens_cpu_runtime.tolist() == [6]
