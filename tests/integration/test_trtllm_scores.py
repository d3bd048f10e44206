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
from trtllm_vtoken.integration.trtllm import scores
from trtllm_vtoken.integration.trtllm.mass import prefill_mass
from trtllm_vtoken.integration.trtllm.scores import (
    QueryRecorder,
    batch_decode_attention_mass,
    prefill_attention_mass,
)
from trtllm_vtoken.runtime.attention import paged_attention
from trtllm_vtoken.runtime.kv_cache import PagedKVCache


def reference_decode_mass(cache: PagedKVCache, q: torch.Tensor, blocks: list[int], kv_len: int) -> torch.Tensor:
    """One decode row's mass [kv_len] from the reference runtime's paged attention, layer by layer."""
    cache.set_batch([blocks], [kv_len])
    return sum(paged_attention(q[layer][None, None], cache, layer, torch.tensor([1]), return_mass=True)[1][0, :kv_len]
               for layer in range(LAYERS))


def test_decode_attention_mass_equals_the_reference_runtimes():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(8, TPB, LAYERS, KV_HEADS, DIM, max_seqs=1, max_blocks_per_seq=4)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    blocks, kv_len = [5, 1, 6], 10
    q = torch.randn(LAYERS, HEADS, DIM, generator=gen)
    want = reference_decode_mass(cache, q, blocks, kv_len)
    got = batch_decode_attention_mass(q[None], cache.pool, [blocks], [kv_len])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs 4 blocks"):
        batch_decode_attention_mass(q[None], cache.pool, [blocks], [13])


def test_the_batchs_decode_mass_is_each_rows_own(monkeypatch):
    """Rows of different lengths in one padded pass: each row equals the reference runtime's mass
    for it alone, its columns past kv_len stay 0 (the padding's keys never enter a softmax), and
    splitting the rows into chunks of one (a tight GATHER_BYTES) gives the same values."""
    gen = torch.Generator().manual_seed(6)
    cache = PagedKVCache(12, TPB, LAYERS, KV_HEADS, DIM, max_seqs=1, max_blocks_per_seq=5)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    lists, kv_lens = [[5, 1, 6], [2], [9, 3, 7, 11, 0]], [10, 3, 17]
    q = torch.randn(3, LAYERS, HEADS, DIM, generator=gen)
    got = batch_decode_attention_mass(q, cache.pool, lists, kv_lens)
    assert got.shape == (3, 17) and got.dtype == torch.float32
    for i, (blocks, kv_len) in enumerate(zip(lists, kv_lens)):
        torch.testing.assert_close(got[i, :kv_len], reference_decode_mass(cache, q[i], blocks, kv_len),
                                   rtol=1e-5, atol=1e-5)
        assert not got[i, kv_len:].any()
    monkeypatch.setattr(scores, "GATHER_BYTES", 1)
    torch.testing.assert_close(batch_decode_attention_mass(q, cache.pool, lists, kv_lens), got, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="row 1: kv_len 5 needs 2 blocks"):
        batch_decode_attention_mass(q, cache.pool, lists, [10, 5, 17])
    with pytest.raises(ValueError, match="row 0: kv_len 0"):
        batch_decode_attention_mass(q, cache.pool, lists, [0, 3, 17])
    with pytest.raises(ValueError, match="3 rows of queries, 2 block lists"):
        batch_decode_attention_mass(q, cache.pool, lists[:2], kv_lens)


def test_query_recorder_keeps_the_decode_rows():
    recorder = QueryRecorder(max_batch_size=4, num_layers=2, head_dim=DIM, device="cpu")
    q = torch.arange(5 * HEADS * DIM, dtype=torch.float32).view(5, HEADS * DIM)  # 2 context + 3 decode
    recorder.record(1, q, num_generation=3)
    assert recorder.q.shape == (4, 2, HEADS, DIM)
    assert torch.equal(recorder.q[:3, 1], q[2:].view(3, HEADS, DIM)) and not recorder.q[:, 0].any()


def test_the_query_buffer_holds_what_a_batch_can_hold():
    """No batch decodes more requests than the pool has blocks (each holds one at least), nor more
    than max_batch_size or max_num_tokens: the manager's buffer is that many rows, not
    max_batch_size's (2048 by default in TensorRT-LLM, ~0.5 GiB at Llama-8B shapes); a captured
    batch's padding rows, after the real ones, are not recorded."""
    assert make_manager("h2o", num_blocks=3).vtoken_queries.max_batch_size == 3  # max_batch_size 4
    assert make_manager("h2o", num_blocks=64).vtoken_queries.max_batch_size == 4
    recorder = make_manager("h2o", num_blocks=3).vtoken_queries
    q = torch.arange(4 * HEADS * DIM, dtype=torch.float32).view(4, HEADS * DIM)  # 3 requests + 1 padding row
    recorder.record(0, q, num_generation=4)
    assert recorder.q.shape == (3, LAYERS, HEADS, DIM)
    assert torch.equal(recorder.q[:, 0], q[:3].view(3, HEADS, DIM))


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
    # H2O's prefill_window: the prompt's last 4 queries, in both hosts (and the bounded pass)
    want = sum(paged_attention(q[layer][None], cache, layer, torch.tensor([prompt]), return_mass=True,
                               mass_from=torch.tensor([prompt - 4]))[1][0, :prompt] for layer in range(LAYERS))
    got = sum(prefill_attention_mass(q[layer], keys[:, layer], chunk=3, window=4) for layer in range(LAYERS))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bounded = sum(prefill_mass(q[layer], keys[:, layer], window=4) for layer in range(LAYERS))
    torch.testing.assert_close(bounded, want, rtol=1e-5, atol=1e-5)
    assert want.sum().item() == pytest.approx(4 * HEADS * LAYERS)


def test_the_managers_recorder_observes_the_policys_prefill_window():
    manager = make_manager("h2o", policy_options={"prefill_window": 2}, mass_workspace_mib=8)
    recorder = manager.vtoken_queries
    assert (recorder.prefill_window, recorder.cap_bytes) == (2, 8 << 20)
    assert make_manager("h2o").vtoken_queries.prefill_window is None
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(5, HEADS, DIM, generator=gen), torch.randn(5, KV_HEADS, DIM, generator=gen)
    recorder.add_prefill(0, q, k)
    torch.testing.assert_close(recorder.prefill[0], prefill_attention_mass(q, k, window=2))
    with pytest.raises(ValueError, match="prefill_window"):
        make_manager("h2o", policy_options={"prefill_window": 0})
    with pytest.raises(ValueError, match="mass_workspace_mib"):
        make_manager("h2o", mass_workspace_mib=0)


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
        # evicted right after prefill, a whole block at a time: 5 -> 5, 9 -> 5 (4 lost, not 3)
        assert step.num_live(request.py_request_id) == len(live) == manager.vtoken.policy.budget.target(n) <= 6


def test_a_mixed_batch_gets_one_mass_prompt_rows_and_decode_rows():
    """One iteration with a prompt (request 1) and a decode row (request 0): the manager's mass
    for the batch is one [2, L] float32 array, the prompt's row the prefill mass the forward summed,
    the decode row recomputed from its recorded queries, each zero past its own kv_len."""
    from tests.integration.test_trtllm_parallel import latest_batch_mass, reference_mass

    manager, gen = make_manager("h2o", budget=64), torch.Generator().manual_seed(8)
    first = make_request(0, prompt_len=6, max_new_tokens=4)
    prefill = ScheduledRequests(context_requests=[first])
    manager.prepare_resources(prefill)
    write_new_kv(manager, first, gen)
    manager.update_resources(prefill)
    prompt = make_request(1, prompt_len=5, max_new_tokens=4)
    batch = ScheduledRequests(context_requests=[prompt], generation_requests=[first])
    manager.prepare_resources(batch)
    for request in (prompt, first):
        write_new_kv(manager, request, gen)
    pool, blocks = manager.vtoken.step.executor.pools[0], manager.get_cache_indices(prompt)
    keys = torch.stack([pool[blocks[t // TPB], :, 0, :, t % TPB].float() for t in range(5)])  # [5, L, Hkv, D]
    metadata = TrtllmAttentionMetadata(max_num_requests=4, kv_cache_manager=manager, request_ids=[1, 0],
                                       num_contexts=1, seq_lens=torch.tensor([5, 1]))
    queries = torch.randn(LAYERS, 6, HEADS * DIM, generator=gen)  # 5 prompt tokens, then the decode row
    for layer in range(LAYERS):
        prompt_keys = torch.cat([keys[:, layer].reshape(5, -1), torch.zeros(1, KV_HEADS * DIM)])
        fused = torch.cat([queries[layer], prompt_keys, torch.zeros(6, KV_HEADS * DIM)], dim=-1)
        record_queries(TrtllmAttention(layer, HEADS, DIM, KV_HEADS), fused, None, metadata)
    decode_blocks, kv_len = manager.get_cache_indices(first), manager.vtoken.step.kv_len(0) + 1
    got = latest_batch_mass(manager, [(1, 5, blocks), (0, kv_len, decode_blocks)])
    assert got.shape == (2, kv_len) and got.dtype == np.float32 and kv_len == 7
    want_prompt = sum(prefill_attention_mass(queries[layer, :5].view(5, HEADS, DIM), keys[:, layer])
                      for layer in range(LAYERS))
    torch.testing.assert_close(torch.from_numpy(got[0, :5]), want_prompt, rtol=1e-5, atol=1e-5)
    assert not got[0, 5:].any()
    want_decode = reference_mass(manager, queries[:, 5].view(LAYERS, HEADS, DIM), decode_blocks, kv_len)
    torch.testing.assert_close(torch.from_numpy(got[1]), want_decode, rtol=1e-4, atol=1e-4)
