# SPDX-License-Identifier: Apache-2.0
"""A Llama-family decoder (GQA, RMSNorm, SwiGLU, RoPE) over the paged KV cache.

Module names follow Hugging Face's ``LlamaForCausalLM`` so its safetensors load as they are.
RoPE is applied with the position ids the caller passes: logical positions (a token's original
position) in "keep" mode, physical ones in "shift" mode, where the cached keys are re-rotated on
compaction (``reclaim/rerotate.py``). Both use the one RoPE description, ``reclaim/rope.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from trtllm_vtoken.reclaim.rope import RopeSpec, apply_rotation, rotation_at
from trtllm_vtoken.runtime.attention import paged_attention
from trtllm_vtoken.runtime.batch_invariance import project
from trtllm_vtoken.runtime.kv_cache import PagedKVCache


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    rope_scaling: tuple[tuple[str, object], ...] = ()
    """The checkpoint's ``rope_scaling`` as sorted items; position-linear types only (rope.py)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        RopeSpec(self.head_dim, self.rope_theta, scaling=self.rope_scaling)  # ValueError if unsupported

    @cached_property
    def rope(self) -> RopeSpec:
        return RopeSpec(self.head_dim, self.rope_theta, scaling=self.rope_scaling)

    @classmethod
    def from_hf(cls, path: str | Path) -> LlamaConfig:
        """Reads a Hugging Face ``config.json`` of a Llama-architecture model."""
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type") != "llama":
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not 'llama'")
        # transformers >= 5 writes rope_parameters; 4.x wrote rope_theta (+ rope_scaling).
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            rope_scaling=tuple(sorted(scaling.items())),
        )

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """A random-initialised model small enough for unit tests (GQA 4:2)."""
        return cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotation(positions: torch.Tensor, rope: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., T, 1, D/2] turning a [..., T, H, D] tensor by RoPE at ``positions`` [..., T].

    The angles are exact (float64) and their cosines rounded once to float32, so a key rotated at
    p and turned back by d later (shift mode) matches one rotated at p - d to float32 rounding.
    Computed once per forward: every layer turns its queries and keys by the same angles."""
    cos, sin = rotation_at(positions, rope)  # [..., T, D/2] float32, from float64 angles
    return cos[..., None, :], sin[..., None, :]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
            row_multiple: int = 0) -> tuple[torch.Tensor, ...]:
        """x: [B, T, hidden] -> q [B, T, Hq, D], k and v [B, T, Hkv, D]; q and k turned by
        ``cos_sin``, the tokens' RoPE cosines and sines (``rotation``)."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = project(self.q_proj, x, row_multiple).view(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = project(self.k_proj, x, row_multiple).view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = project(self.v_proj, x, row_multiple).view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        cos, sin = cos_sin
        return apply_rotation(q, cos, sin, cfg.rope), apply_rotation(k, cos, sin, cfg.rope), v


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, row_multiple: int = 0) -> torch.Tensor:
        hidden = nn.functional.silu(project(self.gate_proj, x, row_multiple)) * project(self.up_proj, x, row_multiple)
        return project(self.down_proj, hidden, row_multiple)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Body(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        q_lens: torch.Tensor,
        cache: PagedKVCache,
        valid: torch.Tensor | None = None,
        return_mass: bool = False,
        logits_at: torch.Tensor | None = None,
        carry_mass: Callable[[torch.Tensor], None] | None = None,
        mass_cuts: torch.Tensor | None = None,
        mass_from: torch.Tensor | None = None,
        row_multiple: int = 0,
        mass_blocks: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step over a batch whose block tables and lengths are already in ``cache``.

        Args:
            input_ids, positions, slots: [B, T] new tokens, their logical positions and the flat
                slots to store their K/V in; rows padded beyond ``q_lens`` (padding slots: -1).
            q_lens: [B] new tokens per row.
            valid, return_mass, mass_cuts, mass_from, mass_blocks: see ``paged_attention``; the
                mass is summed over layers (elementwise, in layer order).
            logits_at: [B] one query index per row: compute logits there only (a prefill needs
                its last token's, and [T, vocab] logits of a long prompt are large).
            carry_mass: Given the mass once every layer's attention has added to it, before the
                last layer's output projection (tensor parallelism: that projection's all-reduce
                sums the mass over the ranks too, in the same collective).
            row_multiple: > 0: batch-invariant, every product on a multiple of this many rows
                (``runtime/batch_invariance.py``); 0: each product as the batch gives it.
        Returns:
            logits [B, T, vocab] ([B, vocab] with ``logits_at``) and the attention mass per
            position (or None).
        """
        x = self.model.embed_tokens(input_ids)
        mass_total = None
        cos_sin = rotation(positions, self.config.rope)
        for layer_idx, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.qkv(h, cos_sin, row_multiple)
            cache.write(layer_idx, slots.flatten(), k.flatten(0, 1), v.flatten(0, 1))
            out, mass = paged_attention(q, cache, layer_idx, q_lens, valid, return_mass, mass_cuts, mass_from,
                                        row_multiple, mass_blocks)
            if mass is not None:
                mass_total = mass if mass_total is None else mass_total + mass
                if carry_mass is not None and layer_idx == len(self.model.layers) - 1:
                    carry_mass(mass_total)
            x = x + project(layer.self_attn.o_proj, out.flatten(2), row_multiple)
            x = x + layer.mlp(layer.post_attention_layernorm(x), row_multiple)
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at]
        return project(self.lm_head, self.model.norm(x), row_multiple), mass_total


def load_llama(folder: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Loads ``config.json`` + ``*.safetensors`` from a Hugging Face model folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    model = LlamaForCausalLM(LlamaConfig.from_hf(folder / "config.json"))
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (model.config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{folder}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(dtype).eval()
