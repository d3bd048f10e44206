# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM adapter with block reuse on (``enable_block_reuse=True``, TensorRT-LLM's
default), over the 1.2.1 ``KVCacheManager`` double, which models when blocks enter the reuse tree
(its docstring cites ``store_context_blocks``, ``remove_sequence`` -> ``releaseBlocks`` /
``storeBlocksForReuse``, and the prefix match of ``add_sequence``). vToken never moves KV into or
out of a prompt block that is or may become reusable, never evicts its tokens, and a request whose
KV it changed is released without being stored, so every block in the reuse tree holds exactly
the KV of the tokens its key names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.test_trtllm_adapter import DIM, HEADS, KV_HEADS, LAYERS, TPB
from tests.integration.trtllm_doubles import CacheType, DataType, KvCacheConfig, KVCacheManager, KVCacheParams, \
    Mapping, ScheduledRequests, TrtllmAttention, TrtllmAttentionMetadata, make_request
from trtllm_vtoken.integration.trtllm.manager import build_manager_class
from trtllm_vtoken.integration.trtllm.patches import record_queries
from trtllm_vtoken.integration.trtllm.scores import prefill_attention_mass
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings

SYSTEM = list(range(100, 110))  # a shared system prompt: 2 full blocks of 4 and 2 tokens


def make_reuse_manager(policy: str, budget: int, partial_reuse: bool = False, copy_on_partial_reuse: bool = True):
    settings = VTokenSettings(policy=policy, budget=budget, check_invariants=True)
    config = KvCacheConfig(enable_block_reuse=True, enable_partial_reuse=partial_reuse,
                           copy_on_partial_reuse=copy_on_partial_reuse, max_tokens=32 * TPB, tokens_per_block=TPB)
    return build_manager_class(KVCacheManager)(
        config, CacheType.SELF, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, tokens_per_block=TPB,
        max_seq_len=64, max_batch_size=4, mapping=Mapping(), dtype=DataType.BF16, vtoken_settings=settings)


def kv_of(token: int, position: int) -> torch.Tensor:
    """The KV a forward writes for ``token`` at logical ``position`` (what a prefix's blocks hold is
    a function of its tokens alone)."""
    gen = torch.Generator().manual_seed(token * 1009 + position)
    return torch.randn(LAYERS, 2, KV_HEADS, DIM, generator=gen)


class Driver:
    def __init__(self, manager) -> None:
        self.manager = manager
        self.pool = manager.vtoken.step.executor.pools[0]

    def write(self, request, start_logical: int, start_position: int, count: int) -> None:
        tokens, blocks = request.get_tokens(0), self.manager.get_cache_indices(request)
        for i in range(count):
            p, t = start_position + i, start_logical + i
            self.pool[blocks[p // TPB], :, :, :, p % TPB] = kv_of(tokens[t], t).to(self.pool.dtype)

    def run(self, request, new_tokens: int) -> None:
        manager, req_id = self.manager, request.py_request_id
        batch = ScheduledRequests(context_requests=[request])
        manager.prepare_resources(batch)
        self.write(request, 0, 0, request.prompt_len)
        manager.update_resources(batch)
        for i in range(new_tokens):
            request.add_new_token(500 + 10 * req_id + i, 0)
            batch = ScheduledRequests(generation_requests=[request])
            step = manager.vtoken.step
            logical, position = step.num_tokens(req_id), step.kv_len(req_id)
            manager.prepare_resources(batch)
            self.write(request, logical, position, 1)
            manager.update_resources(batch)

    def check_tree(self) -> None:
        """Every stored block holds the KV of the tokens its key ends with, position by position."""
        for key, block in self.manager.stored_blocks().items():
            first = (len(key) - 1) // TPB * TPB
            for position in range(first, len(key)):
                want = kv_of(key[position], position).to(self.pool.dtype)
                assert torch.equal(self.pool[block, :, :, :, position % TPB], want), (key, block, position)


def test_reuse_with_eviction_keeps_the_tree_true_and_shares_the_prefix():
    manager = make_reuse_manager("random", budget=4)
    drive = Driver(manager)
    first = make_request(0, 0, 12)
    first.__init__(request_id=0, max_new_tokens=12, input_tokens=SYSTEM + [1, 2, 3],
                   sampling_config=first.sampling_config)
    # 13 prompt tokens (12 in full, protected blocks), 10 new: Random evicts down to the budget of
    # 4 over the 11 others, the protected 12 kept on top
    drive.run(first, new_tokens=10)
    assert manager.vtoken.num_evicted(0) > 0
    prompt_blocks = manager.get_cache_indices(first)[:13 // TPB]
    assert manager.vtoken.step.block_ids(0)[:3] == prompt_blocks  # the prompt's full blocks stayed put
    assert set(range(12)) <= set(manager.vtoken.step.live_tokens(0).tolist())  # and kept their tokens
    drive.check_tree()
    stored_before = manager.stored_blocks()
    manager.free_resources(first)  # changed by vToken: released unstored
    assert manager.stored_blocks() == stored_before  # only its context blocks are in the tree
    drive.check_tree()

    second = make_request(1, 0, 4)
    second.__init__(request_id=1, max_new_tokens=4, input_tokens=SYSTEM + [7],
                    sampling_config=second.sampling_config)
    drive.run(second, new_tokens=1)
    assert manager.get_cache_indices(second)[:2] == prompt_blocks[:2]  # the system prompt came from the tree
    drive.check_tree()
    assert manager.vtoken.num_evicted(1) == 0
    manager.free_resources(second)  # nothing evicted: stored for reuse as TensorRT-LLM does
    assert len(manager.stored_blocks()) > len(stored_before)
    drive.check_tree()
    assert manager.get_num_free_blocks() == 32


def test_without_the_rules_the_tree_would_lie():
    """The same run with vToken told nothing is reusable: compaction moves tokens inside stored
    prompt blocks (or the released blocks are stored with changed content) and the tree's check
    fails -- what the rules prevent."""
    manager = make_reuse_manager("random", budget=12)
    manager._vtoken_share_prompts = lambda written: None  # the rule switched off
    drive = Driver(manager)
    first = make_request(0, 0, 12)
    first.__init__(request_id=0, max_new_tokens=12, input_tokens=SYSTEM + [1, 2, 3],
                   sampling_config=first.sampling_config)
    drive.run(first, new_tokens=10)
    super(type(manager), manager).free_resources(first)  # and released with the request: stored
    try:
        drive.check_tree()
    except AssertionError:
        return
    raise AssertionError("the reuse tree stayed true without the rules: this test proves nothing")


def run_beside(policy: str, with_second: bool, after_step=None):
    """The first request (its system prompt's 2 full blocks then 3 tokens) decodes 10 tokens;
    ``with_second``: a second request with the same system prompt arrives at the first decode
    step, takes the stored prompt blocks from the reuse tree (``add_sequence``) and decodes
    beside it. Returns the manager, the driver, the two requests and the first one's live tokens
    after each step; ``after_step(drive)`` runs after each ``update_resources``."""
    manager = make_reuse_manager(policy, budget=4)
    drive, step = Driver(manager), manager.vtoken.step
    first = make_request(0, 0, 12)
    first.__init__(request_id=0, max_new_tokens=12, input_tokens=SYSTEM + [1, 2, 3],
                   sampling_config=first.sampling_config)
    second = make_request(1, 0, 12)
    second.__init__(request_id=1, max_new_tokens=12, input_tokens=SYSTEM + [4, 5, 6, 7, 8],
                    sampling_config=second.sampling_config)
    batch = ScheduledRequests(context_requests=[first])
    manager.prepare_resources(batch)
    drive.write(first, 0, 0, first.prompt_len)
    manager.update_resources(batch)
    live = []
    for i in range(10):
        others = [second] if with_second and i else []
        for request in [first] + others:
            request.add_new_token(600 + 10 * request.py_request_id + i, 0)
        batch = ScheduledRequests(context_requests=[second] if with_second and i == 0 else [],
                                  generation_requests=[first] + others)
        before = {r.py_request_id: (step.num_tokens(r.py_request_id), step.kv_len(r.py_request_id))
                  for r in batch.generation_requests}
        manager.prepare_resources(batch)
        if with_second and i == 0:
            assert manager.get_cache_indices(second)[:2] == manager.get_cache_indices(first)[:2]  # shared
            drive.write(second, 8, 8, second.prompt_len - 8)  # the reused blocks are not recomputed
        for request in batch.generation_requests:
            drive.write(request, *before[request.py_request_id], 1)
        manager.update_resources(batch)
        live.append(step.live_tokens(0).tolist())
        if after_step is not None:
            after_step(drive)
    return manager, drive, first, second, live


@pytest.mark.parametrize("policy", ["random", "streaming_llm"])
def test_two_running_requests_share_the_system_prompt_while_evicting(policy):
    """The second request arrives while the first decodes: ``add_sequence`` hands it the first's
    stored system-prompt blocks, both hold them at once, and both evict (down to the budget, which
    applies to the tokens outside the protected prompt blocks, never inside them) without the
    tree ever lying. StreamingLLM's batches are decided inside the C++ core's call (its
    selection passes over the protected blocks), Random's in Python before it."""
    checks = []
    manager, drive, first, second, _ = run_beside(policy, True, lambda drive: checks.append(drive.check_tree()))
    step = manager.vtoken.step
    shared = manager.get_cache_indices(first)[:2]
    assert manager.get_cache_indices(second)[:2] == shared and len(checks) == 10
    for request in (first, second):
        assert manager.vtoken.num_evicted(request.py_request_id) > 0
        assert set(range(8)) <= set(step.live_tokens(request.py_request_id).tolist())  # the shared prefix kept
    decided = step.stats.native_decisions
    assert decided > 0 if policy != "random" and step.impl == "cpp" else decided == 0
    manager.free_resources(first)
    manager.free_resources(second)
    drive.check_tree()
    assert manager.get_num_free_blocks() == 32


def test_a_prompt_recovered_from_the_tree_is_scored_from_its_computed_part():
    """H2O with reuse: the second request's context forward runs only the tokens after the reused
    system prompt (``num_cached_tokens_per_seq`` = 8); its queries also attend to the cached
    prefix, whose keys come from the pool. The mass of every token it computes equals a full
    prefill's; the prefix, which vToken never evicts under reuse, gets what these queries give."""
    manager = make_reuse_manager("h2o", budget=64)
    drive, step = Driver(manager), manager.vtoken.step
    gen = torch.Generator().manual_seed(5)
    prompts = {0: SYSTEM + [1, 2, 3], 1: SYSTEM + [4, 5, 6, 7]}
    queries = {r: torch.randn(LAYERS, len(p), HEADS * DIM, generator=gen) for r, p in prompts.items()}
    requests = {}
    for req_id, tokens in prompts.items():
        request = make_request(req_id, 0, 4)
        request.__init__(request_id=req_id, max_new_tokens=4, input_tokens=tokens,
                         sampling_config=request.sampling_config)
        requests[req_id] = request
        batch = ScheduledRequests(context_requests=[request])
        manager.prepare_resources(batch)
        cached = request.context_current_position
        drive.write(request, cached, cached, request.prompt_len - cached)
        computed = slice(cached, request.prompt_len)
        metadata = TrtllmAttentionMetadata(
            max_num_requests=4, kv_cache_manager=manager, request_ids=[req_id], num_contexts=1,
            seq_lens=torch.tensor([request.prompt_len - cached]),
            kv_cache_params=KVCacheParams(use_cache=True, num_cached_tokens_per_seq=[cached]))
        keys = keys_of(tokens)  # [T, L, Hkv, D]
        for layer in range(LAYERS):
            fused = torch.cat([queries[req_id][layer, computed], keys[computed, layer].reshape(-1, KV_HEADS * DIM),
                               torch.zeros(request.prompt_len - cached, KV_HEADS * DIM)], dim=-1)
            record_queries(TrtllmAttention(layer, HEADS, DIM, KV_HEADS), fused, None, metadata)
        manager.update_resources(batch)
    assert requests[1].context_current_position == 8  # two full blocks recovered
    n = len(prompts[1])
    full = sum(prefill_attention_mass(queries[1][layer].view(n, HEADS, DIM), keys_of(prompts[1])[:, layer])
               for layer in range(LAYERS))
    live, mass = step.token_stats(1, "mass")
    assert live.tolist() == list(range(n))
    np.testing.assert_allclose(mass[8:], full[8:].numpy(), rtol=1e-4)  # every computed token as a full prefill
    assert (mass[:8] < full[:8].numpy()).all()  # the prefix: only what the computed queries give
    # Both prefills were decided in the C++ core's call, the second with its reused blocks protected.
    assert step.stats.native_decisions == (2 if step.impl == "cpp" else 0)


def keys_of(tokens: list[int]) -> torch.Tensor:
    """The keys the forward wrote for ``tokens`` (bf16, as the pool holds them): [T, L, Hkv, D]."""
    return torch.stack([kv_of(t, p)[:, 0].to(torch.bfloat16).float() for p, t in enumerate(tokens)])


@pytest.mark.parametrize("policy", ["random", "streaming_llm", "sliding_window"])
def test_a_request_decides_alike_alone_and_beside_a_sharer(policy):
    """The protected tokens are the request's own full prompt blocks, shared or not, so a second
    request holding the same system-prompt blocks changes none of the first's decisions."""
    alone = run_beside(policy, with_second=False)[-1]
    assert alone[-1] != list(range(len(alone[-1]))), "the budget evicts"
    assert run_beside(policy, with_second=True)[-1] == alone


@pytest.mark.parametrize("copy_on_partial_reuse", [True, False])
def test_partial_reuse_hands_over_true_kv_while_vtoken_evicts(copy_on_partial_reuse):
    """Partial reuse, TensorRT-LLM's default (``loadOrAllocateBlocks``, cited in the C++ double).
    The first request evicts (Random, budget 4). A second, arriving while it runs, shares its
    system prompt and one more token of its third prompt block: that block is in use, so its 3
    matched tokens are copied into a block of the second's own (with ``copy_on_partial_reuse``;
    without it a block in use is no candidate and the second computes them). A third arrives after
    the first left: the first's stored third block is a free leaf and is taken over whole. Each
    computes its prompt from its prepopulated length on (not a block boundary), every position of
    its prompt holds its token's KV before its step, and the tree never lies."""
    manager = make_reuse_manager("random", 4, partial_reuse=True, copy_on_partial_reuse=copy_on_partial_reuse)
    drive = Driver(manager)

    def prefill(req_id: int, tokens: list[int]):
        request = make_request(req_id, 0, 4)
        request.__init__(request_id=req_id, max_new_tokens=4, input_tokens=tokens,
                         sampling_config=request.sampling_config)
        batch = ScheduledRequests(context_requests=[request])
        manager.prepare_resources(batch)
        start = request.context_current_position
        drive.write(request, start, start, request.prompt_len - start)
        blocks = manager.get_cache_indices(request)
        for position, token in enumerate(tokens):  # reused, copied, taken over or computed: its token's KV
            want = kv_of(token, position).to(drive.pool.dtype)
            assert torch.equal(drive.pool[blocks[position // TPB], :, :, :, position % TPB], want), position
        manager.update_resources(batch)
        drive.check_tree()
        return request, start

    first = make_request(0, 0, 12)
    first.__init__(request_id=0, max_new_tokens=12, input_tokens=SYSTEM + [1, 2, 3],
                   sampling_config=first.sampling_config)
    drive.run(first, new_tokens=10)
    assert manager.vtoken.num_evicted(0) > 0
    hits = manager.impl.partial_hits
    second, start = prefill(1, SYSTEM + [1, 9, 9])
    assert start == (11 if copy_on_partial_reuse else 8)
    assert hits == {"copied": int(copy_on_partial_reuse), "taken over": 0}
    assert manager.get_cache_indices(second)[2] != manager.get_cache_indices(first)[2]  # its own block
    manager.free_resources(first)  # changed by vToken: released unstored; its context blocks stay stored
    third, start = prefill(2, SYSTEM + [1, 5, 5])
    assert start == 11 and hits["taken over"] == 1
    assert manager.vtoken.num_evicted(2) == 0
    for request in (second, third):
        manager.free_resources(request)
    drive.check_tree()
    assert manager.get_num_free_blocks() == 32

