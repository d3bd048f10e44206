# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/modules/attention.py`` ``Attention`` (1.2-era copies, index ids 3493767310,
55090639134):

- ``__init__`` resolves ``rope_fusion`` once, from the backend class: ``None`` (the default)
  becomes ``attn_cls.support_fused_rope()``; ``True`` falls back to False if the backend does not
  support it. Only an unfused module builds ``rotary_emb``; the backend gets ``pos_embd_params``
  only when fused. Patching ``support_fused_rope`` after construction changes nothing.
- ``forward``: the fused QKV projection, RoPE applied here from the (logical) ``position_ids``
  when unfused, then ``self.attn.forward(qkv, None, None, metadata)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention_backend.interface import PositionalEmbeddingParams, apply_rope
from ..attention_backend.trtllm import TrtllmAttention

BACKENDS = {"TRTLLM": TrtllmAttention}


def get_attention_backend(name: str) -> type:
    return BACKENDS[name]


class Attention(nn.Module):
    def __init__(self, *, hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                 layer_idx: int, attn_backend: str = "TRTLLM", rope_fusion: bool | None = None,
                 pos_embd_params: PositionalEmbeddingParams | None = None, dtype=torch.bfloat16) -> None:
        super().__init__()
        self.layer_idx, self.num_heads, self.num_key_value_heads, self.head_dim = (
            layer_idx, num_attention_heads, num_key_value_heads, head_dim)
        self.pos_embd_params = pos_embd_params or PositionalEmbeddingParams()
        attn_cls = get_attention_backend(attn_backend)
        self.rope_fusion = rope_fusion
        if self.rope_fusion and not attn_cls.support_fused_rope():
            self.rope_fusion = False
        if self.rope_fusion is None:
            self.rope_fusion = attn_cls.support_fused_rope()
        self.rotary_emb = None if self.rope_fusion else self.pos_embd_params
        width = (num_attention_heads + 2 * num_key_value_heads) * head_dim
        self.qkv_proj = nn.Linear(hidden_size, width, bias=False, dtype=dtype)
        self.attn = attn_cls(layer_idx, num_attention_heads, head_dim, num_key_value_heads,
                             pos_embd_params=self.pos_embd_params if self.rope_fusion else None)

    def forward(self, position_ids: torch.Tensor, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if self.rotary_emb is not None:
            tokens, q_width = qkv.shape[0], self.num_heads * self.head_dim
            kv_width = self.num_key_value_heads * self.head_dim
            q = apply_rope(qkv[:, :q_width].reshape(tokens, self.num_heads, self.head_dim), position_ids,
                           self.rotary_emb.rope_theta).reshape(tokens, q_width)
            k = apply_rope(qkv[:, q_width:q_width + kv_width].reshape(tokens, self.num_key_value_heads, self.head_dim),
                           position_ids, self.rotary_emb.rope_theta).reshape(tokens, kv_width)
            qkv = torch.cat([q, k, qkv[:, q_width + kv_width:]], dim=-1)
        return self.attn.forward(qkv, None, None, attn_metadata)
