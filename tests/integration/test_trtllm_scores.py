# SPDX-License-Identifier: Apache-2.0
"""Attention mass on the TensorRT-LLM path, on CPU: decode mass from the recorded queries and
prefill mass summed in the forward both equal the reference runtime's; the patched forward cuts
queries and keys out of TrtllmAttention's fused QKV; prompts reach the policy with their mass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.test_trtllm_adapter import (
    DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    TPB,
    make_manager,
    write_new_kv,
)
from tests.integration.trtllm_doubles import (
    ScheduledRequests,
    TrtllmAttention,
    TrtllmAttentionMetadata,
    make_request,
)
from trtllm_vtoken.integration.trtllm.patches import record_queries
from trtllm_vtoken.integration.trtllm.scores import (
    QueryRecorder,
    decode_attention_mass,
    prefill_attention_mass,
)
from trtllm_vtoken.runtime.attention import paged_attention
from trtllm_vtoken.runtime.kv_cache import PagedKVCache


def test_decode_attention_mass_equals_the_reference_runtimes():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(8, TPB, LAYERS, KV_HEADS, DIM, max_seqs=1, max_blocks_per_seq=4)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    blocks, kv_len = [5, 1, 6], 10
    cache.set_batch([blocks], [kv_len])
    q = torch.randn(LAYERS, HEADS, DIM, generator=gen)
    want = sum(paged_attention(q[layer][None, None], cache, layer, torch.tensor([1]), return_mass=True)[1][0, :kv_len]
               for layer in range(LAYERS))
    got = decode_attention_mass(q, cache.pool, blocks, kv_len)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs 4 blocks"):
        decode_attention_mass(q, cache.pool, blocks, 13)


def test_query_recorder_keeps_the_decode_rows():
    recorder = QueryRecorder(max_batch_size=4, num_layers=2, head_dim=DIM, device="cpu")
    q = torch.arange(5 * HEADS * DIM, dtype=torch.float32).view(5, HEADS * DIM)  # 2 context + 3 decode
    recorder.record(1, q, num_generation=3)
    assert recorder.q.shape == (4, 2, HEADS, DIM)
    assert torch.equal(recorder.q[:3, 1], q[2:].view(3, HEADS, DIM)) and not recorder.q[:, 0].any()


def test_patched_forward_takes_the_queries_out_of_fused_qkv():
    """TrtllmAttention gets q, k and v fused (k = v = None): the first num_heads heads are the
    queries, the next num_kv_heads the keys. One context request of 3 tokens, then 2 decode rows."""
    manager, gen = make_manager("h2o"), torch.Generator().manual_seed(3)
    attention = TrtllmAttention(1, HEADS, DIM, KV_HEADS)
    metadata = TrtllmAttentionMetadata(max_num_requests=4, kv_cache_manager=manager, request_ids=[0, 1, 2],
                                       num_contexts=1, seq_lens=torch.tensor([3, 1, 1]))
    q, k, v = (torch.randn(5, heads * DIM, generator=gen) for heads in (HEADS, KV_HEADS, KV_HEADS))
    prompt_mass = prefill_attention_mass(q[:3].view(3, HEADS, DIM), k[:3].view(3, KV_HEADS, DIM))
    for fused in (True, False):  # separate tensors: q and k as they are
        manager.vtoken_queries.start_batch()
        record_queries(attention, torch.cat([q, k, v], dim=-1) if fused else q, None if fused else k, metadata)
        assert torch.equal(manager.vtoken_queries.q[:2, 1], q[3:].view(2, HEADS, DIM))
        torch.testing.assert_close(manager.vtoken_queries.prefill[0], prompt_mass)
    assert prompt_mass.sum().item() == pytest.approx(3 * HEADS)  # each query's softmax sums to 1


def test_prefill_attention_mass_equals_the_reference_runtimes():
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(8, TPB, LAYERS, KV_HEADS, DIM, max_seqs=1, max_blocks_per_seq=4)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    blocks, prompt = [5, 1, 6], 11
    cache.set_batch([blocks], [prompt])
    q = torch.randn(LAYERS, prompt, HEADS, DIM, generator=gen)
    want = sum(paged_attention(q[layer][None], cache, layer, torch.tensor([prompt]), return_mass=True)[1][0, :prompt]
               for layer in range(LAYERS))
    positions = torch.arange(prompt)
    keys = cache.pool[torch.tensor(blocks)[positions // TPB], :, 0, :, positions % TPB]  # [T, L, Hkv, D]
    got = sum(prefill_attention_mass(q[layer], keys[:, layer], chunk=4) for layer in range(LAYERS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefilled_prompts_reach_the_policy_with_their_attention():
    """A prefill iteration of two prompts through the patched forward's recording: after
    update_resources, H2O holds each prompt token's prefill mass (summed over layers), and with a
    budget below the prompt length it has already evicted down to the budget."""
    manager, gen = make_manager("h2o", budget=6), torch.Generator().manual_seed(5)
    requests = [make_request(req, prompt_len=n, max_new_tokens=4) for req, n in enumerate((5, 9))]
    batch = ScheduledRequests(context_requests=requests)
    manager.prepare_resources(batch)
    for request in requests:
        write_new_kv(manager, request, gen)
    step, pool = manager.vtoken.step, manager.vtoken.step.executor.pools[0]
    metadata = TrtllmAttentionMetadata(max_num_requests=4, kv_cache_manager=manager, request_ids=[0, 1],
                                       num_contexts=2, seq_lens=torch.tensor([5, 9]))
    queries = torch.randn(LAYERS, 14, HEADS * DIM, generator=gen)
    keys = []  # [14, L, Hkv, D]: the K the forward wrote, prompt after prompt
    for request in requests:
        blocks = manager.get_cache_indices(request)
        for token in range(request.prompt_len):  # prefill writes token t at position t
            keys.append(pool[blocks[token // TPB], :, 0, :, token % TPB].float())
    keys = torch.stack(keys)
    for layer in range(LAYERS):
        attention = TrtllmAttention(layer, HEADS, DIM, KV_HEADS)
        fused = torch.cat([queries[layer], keys[:, layer].reshape(14, -1), torch.zeros(14, KV_HEADS * DIM)], dim=-1)
        record_queries(attention, fused, None, metadata)
    manager.update_resources(batch)
    for request, span in zip(requests, (slice(0, 5), slice(5, 14))):
        n = request.prompt_len
        want = sum(prefill_attention_mass(queries[layer, span].view(n, HEADS, DIM), keys[span, layer])
                   for layer in range(LAYERS))
        live, mass = step.token_stats(request.py_request_id, "mass")  # H2O's accumulator, per live token
        np.testing.assert_allclose(mass, want.numpy()[live], rtol=1e-5)
        assert step.num_live(request.py_request_id) == len(live) == min(n, 6)  # evicted right after prefill
