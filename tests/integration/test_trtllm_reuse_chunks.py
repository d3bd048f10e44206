# SPDX-License-Identifier: Apache-2.0
"""Block reuse with chunked prefill in the TensorRT-LLM adapter, over the 1.2.1 doubles: a prompt
whose later chunks have not run yet holds full prompt blocks outside its table row (allocated
ahead by ``add_sequence`` and stored into the reuse tree after its first chunk, as the double's
``store_context_blocks`` does). Another request reuses them, writes its slots there and leaves
while they count as shared on the first one's account; when the first is then cancelled (or
paused: both reach ``free_resources``), those blocks go back to TensorRT-LLM's free queue and must
name no token in the step's slots, or a request handed one as a partly written block finds the
departed request's tokens beside its own (the reference runtime's ``DecodeStep.forget_blocks``)."""

from __future__ import annotations

import torch

from tests.integration.test_trtllm_adapter import DIM, KV_HEADS, LAYERS, TPB
from tests.integration.trtllm121.tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tests.integration.trtllm_doubles import CacheType, DataType, KvCacheConfig, KVCacheManager, Mapping, \
    ScheduledRequests, make_request
from trtllm_vtoken.integration.trtllm.manager import build_manager_class
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings


def test_a_cancelled_prompt_leaves_no_token_in_the_slots_of_its_blocks_past_its_row():
    torch.manual_seed(0)
    config = KvCacheConfig(enable_block_reuse=True, enable_partial_reuse=False, max_tokens=8 * TPB,
                           tokens_per_block=TPB)
    manager = build_manager_class(KVCacheManager)(
        config, CacheType.SELF, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, tokens_per_block=TPB,
        max_seq_len=64, max_batch_size=4, mapping=Mapping(), dtype=DataType.BF16,
        vtoken_settings=VTokenSettings(policy="random", budget=64, check_invariants=True))
    step = manager.vtoken.step

    def run(batch: ScheduledRequests, sample) -> None:
        manager.prepare_resources(batch)
        sample()
        manager.update_resources(batch)

    first = make_request(1, 13, 4)  # 3 full prompt blocks and a token; its first chunk: one block
    first.context_chunk_size = TPB
    run(ScheduledRequests(context_requests=[first]), lambda: None)
    first.move_to_next_context_chunk()
    assert step.block_ids(1) == manager.get_cache_indices(first)[:1] and len(manager._vtoken_prefix[1]) == 3

    second = make_request(2, 14, 2)  # the same first 12 tokens: reuses all 3 blocks
    batch = ScheduledRequests(context_requests=[second])
    manager.prepare_resources(batch)
    assert manager.get_cache_indices(second)[:3] == manager._vtoken_prefix[1]
    second.add_new_token(900, 0)
    second.state = LlmRequestState.GENERATION_IN_PROGRESS
    manager.update_resources(batch)
    batch = ScheduledRequests(generation_requests=[second])
    manager.prepare_resources(batch)
    second.add_new_token(901, 0)
    second.finish_by_reason(None)
    manager.free_resources(second)  # _handle_responses frees it before update_resources
    manager.update_resources(batch)

    manager.free_resources(first)  # cancelled before its second chunk
    step.slots.check_empty(list(manager.impl._free))  # the double's free queue: every block

    third = make_request(3, 22, 2)  # handed the freed blocks, some as partly written ones
    batch = ScheduledRequests(context_requests=[third])
    manager.prepare_resources(batch)
    third.add_new_token(77, 0)
    third.state = LlmRequestState.GENERATION_IN_PROGRESS
    manager.update_resources(batch)
    batch = ScheduledRequests(generation_requests=[third])
    run(batch, lambda: third.add_new_token(78, 0))
    step.check_integrity()
