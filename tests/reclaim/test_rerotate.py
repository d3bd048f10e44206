# SPDX-License-Identifier: Apache-2.0
"""Position-shift mode's key re-rotation: turning a cached key back by d positions equals
recomputing RoPE at the shifted position (float64 exactly, float32/16/bf16 to their rounding),
for both pair layouts and partial rotary dimensions; V and other slots are never touched; the
RoPE variants accepted are the position-linear ones, others are refused with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers import add_sequence, make_table
from trtllm_vtoken.reclaim import cuda_kernel
from trtllm_vtoken.reclaim.planner import commit_plan, plan_dense
from trtllm_vtoken.reclaim.rerotate import KeyRerotation, rerotate_slots
from trtllm_vtoken.reclaim.rope import RopeSpec, apply_rotation, check_shiftable, rotation_at

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
SPECS = {
    "neox": RopeSpec(16),
    "gptj-partial": RopeSpec(16, 500.0, rotary_dim=8, style="gptj"),
    "neox-partial-linear": RopeSpec.from_scaling(16, 10000.0, {"type": "linear", "factor": 4.0}, rotary_dim=12),
    "llama3": RopeSpec.from_scaling(16, 10000.0, LLAMA3),
}
TPB, BLOCKS, LAYERS, HEADS = 4, 12, 3, 2


def rope_at(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, dtype: torch.dtype) -> torch.Tensor:
    """keys [S, layers, heads, D] rotated at positions [S], computed in ``dtype`` (as the model does)."""
    cos, sin = rotation_at(positions, spec, dtype)
    return apply_rotation(keys, cos[:, None, None, :], sin[:, None, None, :], spec)


def pool_with_keys(spec: RopeSpec, dtype: torch.dtype, seed: int = 0):
    """A pool whose K at every slot is a random key rotated at a random position (up to 4000)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(BLOCKS * TPB, LAYERS, HEADS, spec.head_dim, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 4000, (BLOCKS * TPB,), generator=gen)
    pool = torch.randn(BLOCKS, LAYERS, 2, HEADS, TPB, spec.head_dim, generator=gen).to(dtype)
    slots = torch.arange(BLOCKS * TPB)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    pool[slots // TPB, :, 0, :, slots % TPB] = rope_at(raw.to(dtype), positions, spec, compute)
    return pool, raw, positions


# Two roundings to the storage dtype apart (the spec's and the recomputation's), times the key scale.
TOLERANCE = {torch.float64: 1e-14, torch.float32: 2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_turning_back_equals_rope_at_the_shifted_position(name, dtype):
    spec = SPECS[name]
    pool, raw, positions = pool_with_keys(spec, dtype)
    before = pool.clone()
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(BLOCKS * TPB, generator=gen)[:17]
    shifts = torch.randint(1, 300, (17,), generator=gen)
    rerotate_slots(pool, slots, shifts, spec)

    compute = torch.float64 if dtype == torch.float64 else torch.float32
    want = rope_at(raw[slots].to(dtype), positions[slots] - shifts, spec, compute)
    got = pool[slots // TPB, :, 0, :, slots % TPB]
    scale = float(raw.abs().max())
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=TOLERANCE[dtype] * scale)
    # V everywhere, K of other slots and the dimensions past rotary_dim: bit for bit unchanged.
    touched = torch.zeros(BLOCKS * TPB, dtype=torch.bool)
    touched[slots] = True
    assert torch.equal(pool[:, :, 1], before[:, :, 1])
    untouched = torch.arange(BLOCKS * TPB)[~touched]
    assert torch.equal(pool[untouched // TPB, :, 0, :, untouched % TPB], before[untouched // TPB, :, 0, :, untouched % TPB])
    assert torch.equal(got[..., spec.rotary_dim:], before[slots // TPB, :, 0, :, slots % TPB][..., spec.rotary_dim:])


def test_two_shifts_compose_into_one():
    spec = SPECS["llama3"]
    pool, _, _ = pool_with_keys(spec, torch.float64)
    twice, once = pool.clone(), pool.clone()
    slots = torch.arange(0, BLOCKS * TPB, 3)
    rerotate_slots(twice, slots, torch.full_like(slots, 7), spec)
    rerotate_slots(twice, slots, torch.full_like(slots, 30), spec)
    rerotate_slots(once, slots, torch.full_like(slots, 37), spec)
    torch.testing.assert_close(twice, once, rtol=0, atol=1e-12)


def test_scores_keep_their_distance():
    """q(p_q) . k(p_k) equals q(p_q - d) . k(p_k) turned back by d: what shift mode relies on."""
    spec = SPECS["llama3"]
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 1, 16, generator=gen, dtype=torch.float64), torch.randn(1, 1, 1, 16, generator=gen, dtype=torch.float64)
    p_q, p_k, d = torch.tensor([900]), torch.tensor([41]), torch.tensor([233])
    keep = (rope_at(q, p_q, spec, torch.float64) * rope_at(k, p_k, spec, torch.float64)).sum()
    pool = torch.zeros(1, 1, 2, 1, 1, 16, dtype=torch.float64)
    pool[0, :, 0, :, 0] = rope_at(k, p_k, spec, torch.float64)[0]
    rerotate_slots(pool, torch.tensor([0]), d, spec)
    shift = (rope_at(q, p_q - d, spec, torch.float64)[0] * pool[0, :, 0, :, 0]).sum()
    assert abs(float(keep - shift)) < 1e-10


def test_shift_requests_turns_only_live_keys_of_shortened_requests():
    block_pool, table = make_table(num_blocks=BLOCKS, tokens_per_block=TPB)
    spec = SPECS["neox"]
    pool, _, _ = pool_with_keys(spec, torch.float32)
    add_sequence(block_pool, table, 0, 14)
    add_sequence(block_pool, table, 1, 9)
    table.evict_tokens(0, [1, 4, 6])
    removed = {0: table.kv_len(0), 1: table.kv_len(1)}
    block_pool.free(commit_plan(table, plan_dense(table, 0)))  # (copy skipped: slots are what matter)
    removed = {r: removed[r] - table.kv_len(r) for r in removed}
    assert removed == {0: 3, 1: 0}
    rotation = KeyRerotation([pool], spec)
    expected = pool.clone()
    live = torch.as_tensor(table.slots_of(0, table.live_ids(0)))
    rerotate_slots(expected, live, torch.full_like(live, 3), spec)

    assert rotation.shift_requests(table, removed) == 11
    assert torch.equal(pool, expected)
    per_token = 2 * LAYERS * HEADS * spec.head_dim * 4  # read + write of K, fp32
    assert (rotation.stats.passes, rotation.stats.tokens, rotation.stats.bytes) == (1, 11, 11 * per_token)
    assert rotation.shift_requests(table, {1: 0}) == 0 and rotation.stats.passes == 1
    with pytest.raises(ValueError, match="grew"):
        rotation.shift_requests(table, {1: -1})


def test_rerotation_rejects_mismatched_pools():
    with pytest.raises(ValueError, match="head_dim 16"):
        KeyRerotation([torch.zeros(2, 1, 2, 1, 4, 8)], SPECS["neox"])
    with pytest.raises(ValueError, match="share"):
        KeyRerotation([torch.zeros(2, 1, 2, 1, 4, 16), torch.zeros(3, 1, 2, 1, 4, 16)], SPECS["neox"])
    with pytest.raises(ValueError, match="kernel must be"):
        KeyRerotation([torch.zeros(2, 1, 2, 1, 4, 16)], SPECS["neox"], kernel="triton")


# ---- which RoPE variants may be shifted --------------------------------------------------------

@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, {"type": "linear", "factor": 2.0}, LLAMA3])
def test_position_linear_scalings_are_accepted(scaling):
    check_shiftable(scaling)
    RopeSpec.from_scaling(64, 10000.0, scaling)


@pytest.mark.parametrize("scaling, reason", [
    ({"rope_type": "dynamic", "factor": 2.0}, "current sequence length"),
    ({"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "short and long"),
    ({"type": "su"}, "short and long"),
    ({"rope_type": "mrope", "mrope_section": [16, 24, 24]}, "3-D"),
])
def test_non_position_linear_scalings_are_refused_with_the_reason(scaling, reason):
    with pytest.raises(ValueError, match=f"position-linear.*{reason}"):
        check_shiftable(scaling)
    with pytest.raises(ValueError, match=reason):
        RopeSpec.from_scaling(64, 10000.0, scaling)


def test_unsupported_scalings_and_embeddings_are_refused():
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        check_shiftable({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="llama3.*needs.*low_freq_factor"):
        RopeSpec.from_scaling(64, 10000.0, {"type": "llama3", "factor": 8.0})
    for embedding, reason in [("alibi", "physical query-key distance"), ("learned_absolute", "added to the embeddings"),
                              ("long_rope", "short and long")]:
        with pytest.raises(ValueError, match=reason):
            check_shiftable(None, embedding)
    with pytest.raises(ValueError, match="not RoPE"):
        check_shiftable(None, "chatglm")


def test_trtllm_engine_config_gives_the_same_rope():
    pretrained = {"architecture": "LlamaForCausalLM", "hidden_size": 2048, "num_attention_heads": 32,
                  "head_size": 64, "position_embedding_type": "rope_gpt_neox", "rotary_base": 500000.0,
                  "rotary_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    spec = RopeSpec.from_trtllm_config(pretrained)
    assert (spec.head_dim, spec.rotary_dim, spec.style, spec.theta, spec.kind) == (64, 64, "neox", 500000.0, "llama3")
    assert RopeSpec.from_trtllm_config({**pretrained, "position_embedding_type": "rope_gptj", "rotary_pct": 0.5}).rotary_dim == 32
    with pytest.raises(ValueError, match="current sequence length"):
        RopeSpec.from_trtllm_config({**pretrained, "rotary_scaling": {"type": "dynamic", "factor": 2.0}})


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_frequencies_match_transformers(kind):
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3}[kind]
    hf = HFConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=64,
                  rope_parameters={**params, "rope_theta": 10000.0})
    want, _ = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    torch.testing.assert_close(RopeSpec.from_scaling(16, 10000.0, params).inv_freq(), want, rtol=1e-6, atol=0)


def test_runtime_model_with_llama3_scaling_matches_transformers(tmp_path):
    """The reference runtime applies an accepted scaling exactly as Hugging Face does."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    from trtllm_vtoken.runtime.kv_cache import PagedKVCache
    from trtllm_vtoken.runtime.model import load_llama

    torch.manual_seed(0)
    hf_config = HFConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True, rope_parameters={**LLAMA3, "rope_theta": 10000.0})
    hf = HFLlama(hf_config).eval()
    hf_config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    ours = load_llama(tmp_path)
    assert ours.config.rope.kind == "llama3"

    ids = torch.randint(0, 128, (1, 40))
    cache = PagedKVCache(16, 4, 2, 2, 16, 1, 10)
    cache.set_batch([list(range(10))], [40])
    logits, _ = ours(ids, torch.arange(40)[None], torch.arange(40)[None], torch.tensor([40]), cache)
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(logits, want, rtol=0, atol=2e-5)


def test_runtime_refuses_a_checkpoint_whose_rope_is_not_position_linear(tmp_path):
    from trtllm_vtoken.runtime.model import LlamaConfig

    config = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="position-linear.*dynamic"):
        LlamaConfig.from_hf(tmp_path / "config.json")


# ---- the CUDA kernel (GPU machines) --------------------------------------------------------------

needs_kernel = pytest.mark.skipif(cuda_kernel.library_path() is None, reason="CUDA kernels not built")


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernel_matches_the_reference(name, dtype):
    spec = SPECS[name]
    pool, _, _ = pool_with_keys(spec, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    slots = torch.randperm(BLOCKS * TPB, generator=gen)[:23]
    shifts = torch.randint(1, 5000, (23,), generator=gen)
    expected = pool.clone()
    rerotate_slots(expected, slots, shifts, spec)
    gpu = pool.cuda()
    cuda_kernel.rerotate_keys_cuda(gpu, slots.cuda(), shifts.cuda(), spec)
    torch.cuda.synchronize()
    got = gpu.cpu()
    # Equal but for the last bit of a cosine: at most one unit in the last place.
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    bound = ulp * expected.double().abs().clamp_min(1e-30) * 1.01
    assert bool(((got.double() - expected.double()).abs() <= bound).all())
    assert torch.equal(got[:, :, 1], pool[:, :, 1])


@pytest.mark.cuda
@needs_kernel
def test_cuda_kernel_rejects_bad_arguments():
    pool = torch.zeros(4, 1, 2, 1, 4, 16, device="cuda")
    slots = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="contiguous 6-D CUDA"):
        cuda_kernel.rerotate_keys_cuda(pool.cpu(), slots, slots, SPECS["neox"])
    with pytest.raises(ValueError, match="int64"):
        cuda_kernel.rerotate_keys_cuda(pool, slots.int(), slots, SPECS["neox"])
    with pytest.raises(ValueError, match="head_dim"):
        cuda_kernel.rerotate_keys_cuda(pool, slots, slots, RopeSpec(8))
    with pytest.raises(ValueError, match="float64"):
        cuda_kernel.rerotate_keys_cuda(pool.double(), slots, slots, SPECS["neox"])


@pytest.mark.cuda
@needs_kernel
def test_rerotation_uses_the_kernel_on_cuda():
    spec = SPECS["neox"]
    pool, _, _ = pool_with_keys(spec, torch.bfloat16)
    by_kernel, by_torch = pool.cuda(), pool.cuda()
    slots, shifts = np.arange(0, 40, 3), np.full(14, 9)
    kernel = KeyRerotation([by_kernel], spec, kernel="cuda")
    assert kernel.uses_kernel
    kernel.rotate_slots(slots, shifts)
    KeyRerotation([by_torch], spec, kernel="torch").rotate_slots(slots, shifts)
    torch.cuda.synchronize()
    assert float((by_kernel.float() - by_torch.float()).abs().max()) <= 2.0 ** -7 * float(by_torch.float().abs().max())


def test_recovering_keeps_roundings_from_adding_up():
    """bfloat16, Llama-3.1 RoPE, head_dim 128: 16 passes of 16 positions. Turned from the last
    pass's value, a key collects a rounding per pass; recovered first (turned forward by what it has
    been turned back since it was written, rounded to the pool's grid: the value written, wherever
    the roundings stayed within half a unit), it is one rotation from the value written. Keys
    written between passes (at that time's shift) are recovered from their own shift."""
    spec = RopeSpec.from_scaling(128, 500000.0, {**LLAMA3, "original_max_position_embeddings": 8192})
    errors = {}
    for recover in (False, True):
        block_pool, table = make_table(num_blocks=40, tokens_per_block=TPB)
        pool = torch.zeros(40, 1, 2, 2, TPB, 128, dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(5)
        raw = torch.randn(160, 1, 2, 128, generator=gen, dtype=torch.float64)
        rotation, shift, written = KeyRerotation([pool], spec, recover=recover), 0, 0

        def write(count):  # keys of ids [written, written + count) at their position minus the shift
            nonlocal written
            ids = torch.arange(written, written + count)
            slots = torch.as_tensor(table.slots_of(0, ids.tolist()))
            pool[slots // TPB, :, 0, :, slots % TPB] = rope_at(raw[ids], ids - shift, spec, torch.float64).to(
                torch.bfloat16)
            written += count

        add_sequence(block_pool, table, 0, 96)
        write(96)
        for step in range(16):
            if step % 4 == 1:  # four new keys, as decoding adds them
                table.append_tokens(0, block_pool.allocate(1), 4)
                write(4)
            rotation.shift_requests(table, {0: 16})
            shift += 16
        ids = torch.arange(written)
        slots = torch.as_tensor(table.slots_of(0, ids.tolist()))
        exact = rope_at(raw[ids], ids - shift, spec, torch.float64)
        stored = pool[slots // TPB, :, 0, :, slots % TPB].double()
        single = exact.to(torch.bfloat16).double()
        errors[recover] = float(((stored - exact).norm(dim=-1) / exact.norm(dim=-1)).mean())
        errors["single"] = float(((single - exact).norm(dim=-1) / exact.norm(dim=-1)).mean())
    assert errors[False] > 4 * errors["single"]
    assert errors[True] < 0.6 * errors[False] and errors[True] < 3 * errors["single"], errors
