# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallelism and several pools, over the 1.2.1 ``KVCacheManager`` double: a rank holds
only its layers (``get_buffers`` takes the global layer id, ``kv_cache_pool_mapping`` rows are
local), queries recorded by the model's global ``layer_idx`` land in the rank's local rows, and
the decode attention mass covers every pool (layers with different kv-head counts). (Several ranks
deciding together: test_trtllm_ranks.py.)"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.integration.trtllm121.tensorrt_llm.bindings import DataType
from tests.integration.test_trtllm_adapter import DIM, HEADS, TPB, make_manager, write_new_kv
from tests.integration.trtllm_doubles import Mapping, ScheduledRequests, TrtllmAttention, TrtllmAttentionMetadata, \
    make_request
from tests.integration.trtllm121 import tensorrt_llm as trtllm_double
from tests.integration.trtllm121.tensorrt_llm import _utils as utils_double
from trtllm_vtoken.consistency import SingleRank
from trtllm_vtoken.integration.trtllm.patches import record_queries


@pytest.fixture(autouse=True)
def trtllm_utils(monkeypatch):
    """``import tensorrt_llm._utils`` finds the double (only for these tests)."""
    monkeypatch.setitem(sys.modules, "tensorrt_llm", trtllm_double)
    monkeypatch.setitem(sys.modules, "tensorrt_llm._utils", utils_double)


def pipeline_managers(policy: str, **kwargs) -> list:
    """The managers of both stages of a pp=2 instance, built together (the MPI communicator is
    duplicated at construction, a collective every rank joins), one thread per rank."""
    comms = utils_double.ThreadCommDouble.world(2)

    def build(rank: int):
        utils_double.set_mpi_comm(comms[rank])
        try:
            return make_manager(policy, mapping=Mapping(world_size=2, rank=rank, pp_size=2), **kwargs)
        finally:
            utils_double.set_mpi_comm(None)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(build, range(2)))


def reference_mass(manager, q: torch.Tensor, blocks: list[int], kv_len: int,
                   fp8_scales: dict[int, float] | None = None) -> torch.Tensor:
    """Decode mass over the rank's layers from ``get_buffers(global id)``, layer by layer (FP8
    codes times their layer's scale)."""
    total = torch.zeros(kv_len)
    for layer, local in manager.layer_offsets.items():
        keys = manager.get_buffers(layer, kv_layout="HND")[:, 0]  # [P, Hkv, tpb, D]
        k = torch.stack([keys[blocks[p // TPB], :, p % TPB] for p in range(kv_len)]).float()  # [T, Hkv, D]
        k = k * (fp8_scales[layer] if fp8_scales is not None else 1.0)
        group = HEADS // k.shape[1]
        scores = torch.einsum("hd,thd->ht", q[local].float(), k.repeat_interleave(group, dim=1)) / math.sqrt(DIM)
        total += torch.softmax(scores, dim=-1).sum(0)
    return total


def prefill_and_record(manager, layers, gen, fp8_scales: dict[int, float] | None = None):
    """A prompt, then one decode step whose queries the hook records layer by layer; with
    ``fp8_scales`` each layer's attention has an FP8 KV cache of that dequantization scale."""
    request = make_request(0, prompt_len=9, max_new_tokens=8)
    prefill = ScheduledRequests(context_requests=[request])
    manager.prepare_resources(prefill)
    write_new_kv(manager, request, gen)
    manager.update_resources(prefill)
    batch = ScheduledRequests(generation_requests=[request])
    manager.prepare_resources(batch)
    write_new_kv(manager, request, gen)
    metadata = TrtllmAttentionMetadata(max_num_requests=2, kv_cache_manager=manager, request_ids=[0], num_contexts=0,
                                       seq_lens=torch.tensor([1]))
    q = {}
    for layer in layers:  # the model's attention modules carry global layer ids
        kv_heads = manager.num_kv_heads_per_layer[manager.layer_offsets[layer]]
        q[layer] = torch.randn(1, HEADS * DIM, generator=gen)
        fused = torch.cat([q[layer], torch.zeros(1, 2 * kv_heads * DIM)], dim=-1)
        attention = TrtllmAttention(layer, HEADS, DIM, kv_heads)
        if fp8_scales is not None:  # as update_quant_config and a calibrated checkpoint leave it
            attention.has_fp8_kv_cache = True
            attention.kv_scale_quant_orig.fill_(fp8_scales[layer])
        record_queries(attention, fused, None, metadata)
    return q


def test_a_pipeline_rank_maps_global_layers_to_its_own():
    gen = torch.Generator().manual_seed(11)  # the second stage holds global layers 2 and 3
    manager = pipeline_managers("h2o", budget=64, num_layers=4)[1]
    assert manager.layer_offsets == {2: 0, 3: 1} and manager.vtoken_queries.num_layers == 2
    manager.vtoken_consistency.ranks, manager.vtoken_consistency.reduce = SingleRank(), False  # rank 1 alone here
    q = prefill_and_record(manager, [2, 3], gen)
    for layer, local in manager.layer_offsets.items():
        torch.testing.assert_close(manager.vtoken_queries.q[0, local], q[layer].view(HEADS, DIM))
    with pytest.raises(RuntimeError, match=r"layer 0 is not held by this rank \(its layers: \[2, 3\]\)"):
        manager.local_layer(0)
    # The pool views are this rank's pool: a write through get_buffers(3) shows in layer row 1.
    pool = manager.vtoken.step.executor.pools[0]
    manager.get_buffers(3, kv_layout="HND")[0, 0, 0, 0, 0] = 5.0
    assert pool[0, 1, 0, 0, 0, 0].item() == 5.0


def latest_batch_mass(manager, rows):
    """The manager's mass for rows of the batch prepared last (as its update computes it)."""
    batches = manager._vtoken_batches
    prepared = batches.latest()
    return manager._vtoken_batch_mass(rows, prepared, max(kv_len for _, kv_len, _ in rows))


def test_decode_mass_covers_every_pool():
    """Layers with 2 and 1 kv heads live in two pools; the mass sums both (pools[0] alone would
    miss half the layers)."""
    gen = torch.Generator().manual_seed(12)
    manager = make_manager("h2o", budget=64, num_layers=4, num_kv_heads=[2, 1, 2, 1])
    assert manager.kv_cache_pool_mapping.tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]
    assert len(manager.vtoken.step.executor.pools) == 2
    q = prefill_and_record(manager, [0, 1, 2, 3], gen)
    stacked = torch.stack([q[layer].view(HEADS, DIM) for layer in range(4)])
    blocks, kv_len = manager.get_cache_indices(make_request(0, 9, 8)), manager.vtoken.step.kv_len(0) + 1
    got = latest_batch_mass(manager, [(0, kv_len, blocks)])  # the decode token just written included
    assert got.shape == (1, kv_len) and got.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(got[0]), reference_mass(manager, stacked, blocks, kv_len),
                               rtol=1e-4, atol=1e-4)


def test_fp8_pools_score_the_keys_the_attention_reads():
    """``kv_cache_config.dtype="fp8"``: the pool holds codes, each layer's attention its scale
    (``kv_scale_quant_orig``); the decode mass is the one of the dequantized keys, not of the
    codes, and a layer whose scale the hook never saw is an error, not a silent misreading."""
    gen = torch.Generator().manual_seed(13)
    scales = {0: 0.5, 1: 2.0}
    manager = make_manager("h2o", budget=64, num_layers=2, num_kv_heads=[2, 2], dtype=DataType.FP8)
    assert manager.vtoken.step.executor.pools[0].dtype == torch.float8_e4m3fn
    q = prefill_and_record(manager, [0, 1], gen, fp8_scales=scales)
    stacked = torch.stack([q[layer].view(HEADS, DIM) for layer in range(2)])
    blocks, kv_len = manager.get_cache_indices(make_request(0, 9, 8)), manager.vtoken.step.kv_len(0) + 1
    got = torch.from_numpy(latest_batch_mass(manager, [(0, kv_len, blocks)])[0])
    torch.testing.assert_close(got, reference_mass(manager, stacked, blocks, kv_len, scales), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, reference_mass(manager, stacked, blocks, kv_len), atol=1e-2)  # codes as values
    del manager.vtoken_queries.kv_scales[1]
    with pytest.raises(RuntimeError, match="layer 1's KV is FP8"):
        latest_batch_mass(manager, [(0, kv_len, blocks)])
