# SPDX-License-Identifier: Apache-2.0
"""``EngineConfig(batch_invariant=True)``: a request's logits and attention mass are bitwise the
same alone and in any batch, and its prefill's mass over any cached prefix as with caching off
(``runtime/batch_invariance.py``).

Without the mode they are not on this project's CPU build: SmolLM2's six chat prompts served one
at a time and together differ in every cumulative logprob (by up to 2.6e-5, ``vtoken bench
invariance``), and with ``batch_invariant=False`` the SmolLM2 tests below fail but the 124-token
cached-prefix case (it checks that keys padded to another length change nothing). With the mode
on and a prefill's mass summed as a whole and added to its cached prefix's, the prefill-mass tests
fail but the windowed one."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.runtime.attention import paged_attention
from trtllm_vtoken.runtime.batch_invariance import CANDIDATES, find_row_multiple, fold_blocks, padded, project
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM

TPB = 4


def test_find_row_multiple_measures_a_candidate_once(tiny_model):
    multiple = find_row_multiple(tiny_model)
    assert multiple in CANDIDATES
    assert find_row_multiple(tiny_model) == multiple  # measured once per process and thread count


@pytest.mark.parametrize("shape", [(64, 128), (576, 1536)])
def test_a_projected_row_has_the_same_bits_in_every_batch_and_position(shape):
    """Batches of row counts and positions the start-up probe does not try."""
    inner, outer = shape
    g = torch.Generator().manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=inner, intermediate_size=outer,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16))
    linear = model.model.layers[0].mlp.gate_proj
    with torch.no_grad():
        linear.weight.copy_(torch.randn(outer, inner, generator=g))
    multiple = find_row_multiple(model)
    row = torch.randn(inner, generator=g)
    results = []
    with torch.inference_mode():
        for count in (1, 2, 3, 5, 6, 7, 10, 13, 30):
            for position in range(count):
                x = torch.randn(2, count, inner, generator=g)
                x[position % 2, position] = row
                y = project(linear, x, multiple)
                torch.testing.assert_close(y, linear(x), rtol=1e-5, atol=1e-4)  # another kernel: rounding
                results.append(y[position % 2, position])
    assert all(torch.equal(results[0], r) for r in results)


def _cache_with_rows(rows: list[tuple[list[int], int]], seed: int) -> tuple[PagedKVCache, torch.Tensor]:
    """A cache with one batch row per (blocks, kv_len) and random K/V in its pool."""
    cache = PagedKVCache(32, TPB, 1, 2, 16, max_seqs=len(rows), max_blocks_per_seq=8)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=torch.Generator().manual_seed(seed)))
    cache.set_batch([blocks for blocks, _ in rows], [kv_len for _, kv_len in rows])
    valid = torch.rand(len(rows), 8 * TPB, generator=torch.Generator().manual_seed(seed + 1)) > 0.2
    return cache, valid


def test_each_row_alone_equals_the_batched_attention_and_keeps_its_bits_in_any_batch(tiny_model):
    """Per-row attention against the batched one (float rounding), masks, mass cuts and the
    prefill window included; and each row's output and mass bitwise the same computed alone."""
    multiple = find_row_multiple(tiny_model)
    rows = [([3, 9, 4], 11), ([7], 2), ([12, 13, 1, 2, 5], 19), ([20, 21], 8)]
    q_lens = [3, 1, 6, 2]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(rows), max(q_lens), 4, 16, generator=g)
    cuts = torch.tensor([[1, 3], [0, 1], [4, 6], [2, 2]])
    mass_from = torch.tensor([1, 0, 2, 0])
    cache, valid = _cache_with_rows(rows, seed=3)
    q_lens_t = torch.tensor(q_lens)
    want = paged_attention(q, cache, 0, q_lens_t, valid, True, cuts, mass_from)
    got = paged_attention(q, cache, 0, q_lens_t, valid, True, cuts, mass_from, row_multiple=multiple)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for b, row in enumerate(rows):
        alone, alone_valid = _cache_with_rows([row], seed=3)
        alone_valid[0] = valid[b]
        out, mass = paged_attention(q[b : b + 1, : q_lens[b]], alone, 0, q_lens_t[b : b + 1], alone_valid, True,
                                    cuts[b : b + 1], mass_from[b : b + 1], row_multiple=multiple)
        assert torch.equal(out[0], got[0][b, : q_lens[b]])
        width = mass.shape[-1]
        assert torch.equal(mass[0], got[1][b, :, :width]) and not got[1][b, :, width:].any()


def test_block_mass_equals_the_mass_and_its_cuts_and_takes_one_row(tiny_model):
    """``mass_blocks``: a prefill row's mass per block of its positions, summed, is its mass; the
    running sums at block ends are its cuts (float rounding); windowed, the observed half is the
    total from ``mass_from``. Batches of rows, or forwards that are not batch-invariant, are refused."""
    multiple = find_row_multiple(tiny_model)
    row, q_len, offset = ([3, 9, 4, 6, 1, 7], 23), 10, 1  # queries at positions 13 .. 22: blocks 3 .. 5
    q = torch.randn(1, q_len, 4, 16, generator=torch.Generator().manual_seed(2))
    cache, valid = _cache_with_rows([row], seed=3)
    lens, mass_from = torch.tensor([q_len]), torch.tensor([4])
    cuts = torch.tensor([[TPB - offset, 2 * TPB - offset]])  # the ends of the row's first two blocks
    _, blocks = paged_attention(q, cache, 0, lens, valid, True, None, mass_from, multiple, (offset, TPB))
    _, want = paged_attention(q, cache, 0, lens, valid, True, cuts, None, multiple)
    _, windowed = paged_attention(q, cache, 0, lens, valid, True, None, mass_from, multiple)
    assert blocks.shape[:3] == (1, 2, 3)  # every query's and the observed ones', 3 blocks
    states = torch.stack(fold_blocks(torch.zeros(blocks.shape[-1]), blocks[0, 0]))
    torch.testing.assert_close(states[:2], want[0, :2])
    torch.testing.assert_close(states[-1], want[0, -1])
    torch.testing.assert_close(blocks[0, 1].sum(dim=0), windowed[0])
    two_rows, two_valid = _cache_with_rows([row, row], seed=3)
    with pytest.raises(ValueError, match="one row only"):
        paged_attention(q.expand(2, -1, -1, -1), two_rows, 0, lens.expand(2), two_valid, True, None, None, multiple,
                        (offset, TPB))
    with pytest.raises(ValueError, match="one row only"):
        paged_attention(q, cache, 0, lens, valid, True, None, None, 0, (offset, TPB))


def test_padded_rounds_up_to_a_multiple():
    assert [padded(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    assert padded(5, 0) == 5


def test_batch_invariant_runs_on_the_cpu_and_one_rank_with_a_model():
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel

    with pytest.raises(ValueError, match="batch_invariant runs on the CPU"):
        EngineConfig(batch_invariant=True, device="cuda")
    with pytest.raises(ValueError, match="batch_invariant runs on one rank"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="simulated backend runs no products"):
        Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"]), EngineConfig(batch_invariant=True))


@pytest.fixture(scope="module")
def smollm2():
    from trtllm_vtoken.cli.bench_common import load_model

    _, model, tokenizer = load_model(None)
    return model, tokenizer


@pytest.mark.parametrize("variant", ["native", "vtoken"])
def test_smollm2_logprobs_are_bitwise_the_same_alone_and_in_a_batch(smollm2, variant):
    """Each request alone (reusing the cached chat template, one decode row a step) and all
    together (computed afresh, three rows), as ``vtoken bench invariance`` serves them: the same
    tokens, the same eviction decisions and the same log-probabilities to the last bit."""
    from trtllm_vtoken.bench.invariance import CHAT, InvarianceBenchConfig, serve

    model, tokenizer = smollm2
    prompts = [tokenizer.encode(q, chat=True) for q in CHAT[:3]]
    cfg = InvarianceBenchConfig(sharegpt_requests=0, new_tokens=8)
    alone, together = (serve(model, prompts, cfg, t, variant=variant, batch_invariant=True) for t in (False, True))
    assert alone["cached_prompt_tokens"] > 0
    for key in ("outputs", "evictions", "cumulative_logprobs", "logprobs"):
        assert alone[key] == together[key], key
    if variant != "native":
        assert any(alone["evictions"])


def test_the_row_multiple_is_measured_for_the_thread_count_the_forward_runs_on(tiny_model):
    from trtllm_vtoken.runtime.engine import Engine

    engine = Engine(tiny_model, EngineConfig(batch_invariant=True, num_blocks=16, max_seq_len=64))
    threads = torch.get_num_threads()
    assert engine.forwards.invariance()[0] in CANDIDATES
    try:
        torch.set_num_threads(1)
        assert engine.forwards.invariance() in {(p, 1) for p in CANDIDATES}
        assert sorted(engine.forwards._row_multiples) == sorted({1, threads})
    finally:
        torch.set_num_threads(threads)
    assert Engine(tiny_model, EngineConfig(num_blocks=16, max_seq_len=64)).forwards.invariance() == (0, threads)


def test_smollm2_is_batch_invariant_at_two_threads_too(smollm2):
    """At two intra-op threads (a 2-core Xeon with AMX: no row multiple serves them, 16 serves
    one) the forward runs on the threads some multiple serves: the process's, or one thread with
    a warning. Either way the log-probabilities are bitwise the same alone and in a batch, and
    the process's thread count is what it was."""
    import warnings

    from trtllm_vtoken.bench.invariance import CHAT, InvarianceBenchConfig, serve
    from trtllm_vtoken.runtime.batch_invariance import invariant_products

    model, tokenizer = smollm2
    prompts = [tokenizer.encode(q, chat=True) for q in CHAT[:2]]
    cfg = InvarianceBenchConfig(sharegpt_requests=0, new_tokens=6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            multiple, used = invariant_products(model)
            alone, together = (serve(model, prompts, cfg, t, variant="native", batch_invariant=True)
                               for t in (False, True))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert multiple in CANDIDATES and used in (1, 2)
    assert any("the forward runs on one thread" in str(w.message) for w in caught) == (used == 1)
    for key in ("outputs", "cumulative_logprobs", "logprobs"):
        assert alone[key] == together[key], key


@pytest.mark.parametrize("variant, length", [("native", 35), ("vtoken", 35), ("vtoken", 124)])
def test_smollm2_logprobs_are_bitwise_the_same_over_a_prefix_another_prompt_cached(smollm2, variant, length):
    """A prompt over the first 32 tokens a 40-token prompt left cached and with prefix caching
    off: 35 tokens (the cached run's prefill computes 3 rows; without the mode their products
    take another kernel than a fresh prefill's 35 rows and the test fails), 124 tokens (the cached
    blocks were computed with keys padded to 48, a fresh prefill pads them to 128)."""
    from trtllm_vtoken.policies.request_settings import EvictionSettings
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    model, tokenizer = smollm2
    text = "Write a long story about a lighthouse keeper who finds a message in a bottle, with many details."
    tokens = tokenizer.encode(" ".join([text] * 4), chat=True)[:length]
    results = []
    for caching in (True, False):
        engine = Engine(model, EngineConfig(variant=variant, policy="h2o", budget=0.5, tokens_per_block=16,
                                            num_blocks=32, max_batch_size=2, max_seq_len=160, batch_invariant=True,
                                            prefix_caching=caching))
        if caching:
            engine.add_request(tokens[:40], SamplingParams(max_tokens=1, eviction=EvictionSettings(policy="native")))
            while engine.has_unfinished():
                engine.step()
        req_id = engine.add_request(tokens, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1))
        while engine.has_unfinished():
            engine.step()
        assert engine.stats.cached_prompt_tokens == (32 if caching else 0)
        results.append(engine.pop_finished(req_id))
    assert results[0].output_ids == results[1].output_ids and results[0].logprobs == results[1].logprobs


def _record_prefill_masses(engine) -> list[torch.Tensor]:
    """The list each of ``engine``'s prefill forwards adds the mass its policy observes to."""
    run, masses = engine.forwards.run, []

    def recording(*args, **kwargs):
        logits, mass = run(*args, **kwargs)
        if kwargs.get("prefill"):
            masses.append(mass.clone())
        return logits, mass

    engine.forwards.run = recording
    return masses


def test_smollm2_prefill_mass_is_bitwise_the_same_over_a_prefix_another_prompt_cached(smollm2):
    """The mass a prompt's policy observes at its prefill (what decides its first evictions): over
    two blocks another prompt left cached with their payload, and with prefix caching off. The
    prefill sums its blocks' mass onto the payload in block order, as one prefill over the whole
    prompt does (``fold_blocks``); summed as a whole and added to the payload, the two differed in
    their last bits."""
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    model, tokenizer = smollm2
    text = "Write a long story about a lighthouse keeper who finds a message in a bottle, with many details."
    tokens = tokenizer.encode(" ".join([text] * 4), chat=True)[:70]
    observed = []
    for caching in (True, False):
        engine = Engine(model, EngineConfig(variant="vtoken", policy="h2o", budget=0.5, tokens_per_block=16,
                                            num_blocks=32, max_batch_size=2, max_seq_len=160, batch_invariant=True,
                                            prefix_caching=caching))
        if caching:
            engine.add_request(tokens[:40], SamplingParams(max_tokens=1))
            while engine.has_unfinished():
                engine.step()
        masses = _record_prefill_masses(engine)
        engine.add_request(tokens, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        assert engine.stats.cached_prompt_tokens == (32 if caching else 0) and len(masses) == 1
        observed.append(masses[0])
    assert observed[0].shape == observed[1].shape and observed[0][0, :70].sum() > 0
    assert torch.equal(observed[0], observed[1])


@pytest.mark.parametrize("policy, options", [("h2o", {}), ("h2o", {"prefill_window": 6}), ("scissorhands", {})])
def test_a_prefill_mass_folds_onto_any_cached_prefix_to_the_same_bits(tiny_model, policy, options):
    """Prompts of one stem, 9 to 41 tokens, served one after another: each takes the blocks the one
    before left cached (their payloads attached by prefills that took shorter prefixes; with H2O's
    prefill_window, none reaching the window), and the mass its policy observes at its prefill
    is bitwise the mass with prefix caching off."""
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    stem = torch.randint(3, 128, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    observed = {}
    for caching in (True, False):
        # a budget no prompt reaches: blocks a request evicts inside are not cached for later ones
        engine = Engine(tiny_model, EngineConfig(variant="vtoken", policy=policy, budget=48, policy_options=options,
                                                 tokens_per_block=TPB, num_blocks=64, max_seq_len=64,
                                                 batch_invariant=True, prefix_caching=caching))
        masses = _record_prefill_masses(engine)
        cached = []
        for length in (9, 17, 25, 33, 41):
            before = engine.stats.cached_prompt_tokens
            engine.add_request(stem[:length], SamplingParams(max_tokens=2, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            cached.append(engine.stats.cached_prompt_tokens - before)
        observed[caching] = masses
        if caching:  # every prompt but the first took a cached prefix (short of the window's queries)
            assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached
    assert len(observed[True]) == len(observed[False]) == 5
    for with_cache, without in zip(observed[True], observed[False]):
        assert torch.equal(with_cache, without)
