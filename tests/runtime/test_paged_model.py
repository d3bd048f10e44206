# SPDX-License-Identifier: Apache-2.0
"""The paged model against a dense, cache-free reference built from the same weights.

Three views of one sequence must agree: a dense reference with a key mask for evicted tokens,
naive-evict (paged, dead tokens masked in place) and vToken dense (dead tokens' slots refilled
by relocation, no mask, compacted physical order). This is the end-to-end check that relocation
plus never-re-rotated RoPE changes nothing the model can see.
"""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.policies import make_policy, policy_view
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM, rotation

TPB = 4


def reference_logits(model: LlamaForCausalLM, ids: list[int], dead_at: list[set[int]]) -> torch.Tensor:
    """Last-token logits of a cache-free causal forward in which query ``i`` does not see the
    tokens ``dead_at[i]`` (those evicted before token ``i`` was processed)."""
    cfg = model.config
    x = model.model.embed_tokens(torch.tensor([ids]))
    n = len(ids)
    pos = torch.arange(n)
    allowed = pos[None, :] <= pos[:, None]
    for i, dead in enumerate(dead_at):
        allowed[i, list(dead)] = False
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    with torch.inference_mode():
        for layer in model.model.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), rotation(pos[None], cfg.rope))
            k = k.repeat_interleave(group, dim=2)
            v = v.repeat_interleave(group, dim=2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out = torch.einsum("bhqk,bkhd->bqhd", probs, v).flatten(2)
            x = x + layer.self_attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.model.norm(x))[0, -1]


class OneSequence:
    """Just enough engine to drive one request through the paged model (blocks scrambled)."""

    def __init__(self, model: LlamaForCausalLM, mode: str | None) -> None:
        cfg = model.config
        self.model, self.mode = model, mode
        self.pool = BlockPool(64, TPB)
        self.pool.allocate(7)  # start from scrambled block ids, not 0, 1, 2, ...
        self.table = TokenTable(TPB, self.pool.is_shared)
        self.cache = PagedKVCache(64, TPB, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                  cfg.head_dim, max_seqs=1, max_blocks_per_seq=16)
        config = ReclaimConfig(mode=mode or "dense", check_invariants=True)
        self.backend = ReclaimBackend(self.table, self.pool, TorchCopyExecutor([self.cache.pool]), config)
        self.table.add_request(0)

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Writes ``tokens`` after the request's tokens, returns the last token's logits."""
        seq = self.table.seq(0)
        blocks, start = list(seq.block_ids), seq.kv_len
        while len(blocks) * TPB < start + len(tokens):
            blocks += self.pool.allocate(1)
        slots = [blocks[p // TPB] * TPB + p % TPB for p in range(start, start + len(tokens))]
        positions = list(range(seq.num_tokens, seq.num_tokens + len(tokens)))  # logical
        self.cache.set_batch([blocks], [start + len(tokens)])
        valid = None
        if self.mode != "dense":
            live = self.table.position_live_mask(0).tolist() + [True] * len(tokens)
            valid = torch.zeros(1, 16 * TPB, dtype=torch.bool)
            valid[0, : len(live)] = torch.tensor(live)
        logits, _ = self.model(torch.tensor([tokens]), torch.tensor([positions]), torch.tensor([slots]),
                               torch.tensor([len(tokens)]), self.cache, valid)
        self.table.sync_new_tokens(0, blocks, start + len(tokens))
        return logits[0, -1]

    def evict(self, token_ids: list[int]) -> None:
        self.table.evict_tokens(0, token_ids)
        if self.mode is not None:
            self.backend.reclaim([0], pressure=True)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def test_paged_prefill_and_decode_match_dense_reference(model):
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = OneSequence(model, mode=None)
    got = engine.step(ids[:17])
    torch.testing.assert_close(got, reference_logits(model, ids[:17], [set()] * 17), rtol=1e-4, atol=1e-4)
    for n in range(18, 24):
        got = engine.step([ids[n - 1]])
        torch.testing.assert_close(got, reference_logits(model, ids[:n], [set()] * n), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["naive", "dense", "lazy"])
@pytest.mark.parametrize("policy", ["streaming_llm", "random", "h2o"])
def test_eviction_modes_agree_with_masked_reference(model, mode, policy):
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = OneSequence(model, mode=None if mode == "naive" else mode)
    chooser = make_policy(policy, 12, **({"n_sink": 2} if policy == "streaming_llm" else {}))
    dead: set[int] = set()
    dead_at: list[set[int]] = [set()] * 20
    engine.step(ids[:20])
    for n in range(21, 41):
        live = engine.table.live_ids(0)
        chooser.observe(0, live, torch.rand(len(live), generator=torch.Generator().manual_seed(n)).numpy())
        evict = chooser.select(policy_view(engine.table, 0)).tolist()
        engine.evict(evict)
        dead = dead | set(evict)
        dead_at.append(dead)
        got = engine.step([ids[n - 1]])
        torch.testing.assert_close(got, reference_logits(model, ids[:n], dead_at), rtol=1e-4, atol=1e-4)
    if mode == "dense":
        assert len(engine.table.block_ids(0)) <= -(-(engine.table.num_live(0) + 1) // TPB)
    if mode != "naive":
        assert engine.backend.stats.plans > 0 and engine.backend.stats.invariant_checks == engine.backend.stats.plans


def test_load_llama_from_hugging_face_folder(tmp_path, model):
    import json

    from safetensors.torch import save_file

    from trtllm_vtoken.runtime.model import load_llama

    cfg = model.config
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": True,
        "torch_dtype": "float32", "architectures": ["LlamaForCausalLM"],
    }))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_llama(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="is not 'llama'"):
        load_llama(tmp_path)
