# SPDX-License-Identifier: Apache-2.0
"""Decode as CUDA graphs: replay after the block-offsets table is rewritten reads the new blocks,
and a graph-replaying engine produces what the eager engine produces."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.runtime.test_engine import VARIANTS, config, prompts, run
from trtllm_vtoken.reclaim.copy import relocate_slots
from trtllm_vtoken.runtime.cuda_graph import DecodeGraphs, buckets
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB = 4


def test_buckets_are_powers_of_two_up_to_the_batch_limit():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(8) == [1, 2, 4, 8]


def test_graphs_refuse_a_cpu_cache():
    model = LlamaForCausalLM(LlamaConfig.tiny())
    cache = PagedKVCache(8, TPB, 2, 2, 16, max_seqs=2, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, cache, 2, masked=False, return_mass=False)


def _prefill(model, cache, rows):
    """Eager prefill of each (tokens, blocks) row into the cache."""
    for tokens, blocks in rows:
        n = len(tokens)
        cache.set_batch([blocks], [n])
        slots = torch.tensor([[blocks[p // TPB] * TPB + p % TPB for p in range(n)]], device="cuda")
        model(torch.tensor([tokens], device="cuda"), torch.arange(n, device="cuda")[None], slots,
              torch.tensor([n], device="cuda"), cache)


@pytest.mark.cuda
@pytest.mark.parametrize("masked", [False, True])
def test_replay_after_offset_rewrite_reads_the_new_blocks(masked):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).cuda().eval()
    cfg = model.config
    cache = PagedKVCache(16, TPB, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         max_seqs=4, max_blocks_per_seq=4, device="cuda")
    a, b = [5, 9, 2, 7, 1, 3, 8, 4, 6, 11], [12, 3, 3, 9, 40, 2]
    _prefill(model, cache, [(a, [0, 1, 2]), (b, [3, 4])])
    graphs = DecodeGraphs(model, cache, 4, masked=masked, return_mass=True)
    width = 4 * TPB
    valid = torch.zeros(2, width, dtype=torch.bool, device="cuda") if masked else None
    if masked:
        valid[0, :11] = True
        valid[1, :7] = True

    def step(blocks_a, blocks_b):
        cache.set_batch([blocks_a, blocks_b], [11, 7])
        ids = torch.tensor([[17], [23]])
        pos = torch.tensor([[10], [6]])
        slots = torch.tensor([[blocks_a[2] * TPB + 2], [blocks_b[1] * TPB + 2]])
        logits, mass = graphs.run(ids, pos, slots, valid)
        return logits.clone(), mass.clone()

    before, mass_before = step([0, 1, 2], [3, 4])
    cache.set_batch([[0, 1, 2], [3, 4]], [11, 7])
    eager, _ = model(torch.tensor([[17], [23]], device="cuda"), torch.tensor([[10], [6]], device="cuda"),
                     torch.tensor([[10], [18]], device="cuda"), torch.ones(2, dtype=torch.long, device="cuda"),
                     cache, valid, return_mass=True, logits_at=torch.zeros(2, dtype=torch.long, device="cuda"))
    torch.testing.assert_close(before, eager, rtol=1e-4, atol=1e-4)

    # Move sequence a's blocks 0, 1, 2 to 9, 10, 11, poison the old ones, rewrite the table.
    src = torch.arange(0, 3 * TPB, device="cuda")
    relocate_slots(cache.pool, src, src + 9 * TPB)
    cache.pool[:3] = float("nan")
    after, mass_after = step([9, 10, 11], [3, 4])
    assert graphs.captures == 1 and graphs.replays == 2
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mass_after, mass_before, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("variant,mode", [("native", "dense")] + VARIANTS)
def test_graph_engine_matches_eager_engine(variant, mode):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eager = run(Engine(copy.deepcopy(model), config(variant=variant, mode=mode, device="cuda",
                                                    cuda_graphs=False), record_trace=True), prompts(), params)
    engine = Engine(copy.deepcopy(model), config(variant=variant, mode=mode, device="cuda"), record_trace=True)
    graphed = run(engine, prompts(), params)
    assert engine.graphs is not None and engine.graphs.replays > 0
    for a, b in zip(eager, graphed):
        assert a.evictions == b.evictions and a.output_ids == b.output_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=1e-3, atol=1e-3)


class EagerDecodeGraphs:
    """``DecodeGraphs.run``'s contract without the capture (no GPU here): one query a row, the
    logits and, with ``return_mass``, the [B, width] mass; no mass cuts. Records its batches."""

    return_mass = True

    def __init__(self, model, cache) -> None:
        self.model, self.cache, self.batches = model, cache, []

    def run(self, input_ids, positions, slots, valid):
        self.batches.append(input_ids.shape[0])
        ones = torch.ones(input_ids.shape[0], dtype=torch.long)
        return self.model(input_ids, positions, slots, ones, self.cache, valid, return_mass=True, logits_at=ones - 1)


def test_a_one_token_prefill_that_stores_a_block_takes_the_eager_forward():
    """With 1-token blocks a one-token prompt (or one whose tokens but the last are cached) stores
    a block at its prefill, whose mass is cut there for prefix caching; the decode graphs return no
    cuts, so that prefill runs eagerly and the decode rows replay."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    engine = Engine(model, config(variant="vtoken", policy="h2o", budget=0.5, tokens_per_block=1, num_blocks=64,
                                  overlap_scheduler=False))
    graphs = engine.forwards.graphs = EagerDecodeGraphs(model, engine.kv.cache)
    eager = Engine(model, config(variant="vtoken", policy="h2o", budget=0.5, tokens_per_block=1, num_blocks=64,
                                 overlap_scheduler=False))
    got = run(engine, [[5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    want = run(eager, [[5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert got.output_ids == want.output_ids and got.evictions == want.evictions
    assert len(graphs.batches) == 3  # the 3 decode forwards; not the prefill


@pytest.mark.cuda
def test_a_one_token_prompt_with_one_token_blocks_runs_under_graphs():
    model = LlamaForCausalLM(LlamaConfig.tiny()).cuda().eval()
    engine = Engine(model, config(variant="vtoken", policy="h2o", budget=0.5, tokens_per_block=1, num_blocks=64,
                                  device="cuda"))
    out = run(engine, [[5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.output_ids) == 4
