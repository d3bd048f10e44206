# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/model_engine.py`` ``PyTorchModelEngine``: its ``__init__``
builds the model (``self.model``), so every ``Attention.__init__`` (and its ``rope_fusion``)
runs here, before the executor creator goes on to the KV cache. The model: a tiny decoder whose
attention layers are this pipeline rank's (``mapping.pp_layers``) with their global ids, bf16;
``model.model_config`` carries ``pretrained_config``, ``attn_backend``,
``sparse_attention_config`` and ``is_generation`` as the real ``ModelConfig`` does."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ..modules.attention import Attention

TINY = {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8}


class DecoderModel(nn.Module):
    def __init__(self, config: dict, mapping, attn_backend: str) -> None:
        super().__init__()
        self.model_config = SimpleNamespace(pretrained_config=SimpleNamespace(**config), attn_backend=attn_backend,
                                            sparse_attention_config=None, is_generation=True)
        self.layers = nn.ModuleList(
            Attention(hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
                      num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                      layer_idx=layer, attn_backend=attn_backend)
            for layer in mapping.pp_layers(config["num_hidden_layers"]))


class PyTorchModelEngine:
    def __init__(self, *, model_path=None, llm_args=None, mapping=None, attn_runtime_features=None, dist=None,
                 spec_config=None, is_draft_model: bool = False, **kwargs) -> None:
        self.llm_args, self.mapping = llm_args, mapping
        self.dtype = torch.bfloat16
        self.max_seq_len = llm_args.max_seq_len or 256
        self.max_num_tokens = llm_args.max_num_tokens
        self.model = DecoderModel(dict(TINY), mapping, llm_args.attn_backend)
