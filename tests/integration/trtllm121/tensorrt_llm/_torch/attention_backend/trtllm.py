# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/attention_backend/trtllm.py`` (1.2-era copies, index ids 51955176560,
55410938029; RocketKV's subclass in ``sparse/rocket.py``, index id 445290634).

``TrtllmAttention``:
- ``support_fused_rope()`` and ``support_fused_qkv()`` are classmethods returning True;
  ``Metadata`` is the class attribute naming its metadata class.
- Built with ``pos_embd_params`` only when the module fuses RoPE. Then ``forward`` gets q/k
  un-rotated and the op rotates them itself: a context token at ``cached + i``, a generation
  token at ``kv_len - 1`` (the fused kernel's ``tlength``; decoderMaskedMultiheadAttention), a
  physical position. It gets the fused QKV tensor ``[tokens, (heads + 2 * kv_heads) * head_dim]``
  with ``k = v = None`` (``Attention.convert_qkv`` for a backend with fused QKV).
- ``rotated_q`` keeps the queries as the kernel finally uses them (test view of the kernel).
- The op writes each row's new keys and values into the paged cache at the row's positions
  ``[kv_len - seq_len, kv_len)`` (``kv_len`` from ``prepare()``: what vToken's metadata makes
  physical), addressing blocks through ``kv_cache_block_offsets`` (entry = block *
  layers_in_pool * kv_factor + field; the layer's pool and index in it from
  ``kv_cache_pool_mapping``), HND inside a block (``invokeQKVPreprocessing`` for context rows,
  the MMHA kernel for generation rows; ``thop/attentionOp.cpp``).

``TrtllmAttentionMetadata.prepare()``: ``prompt_lens`` -> the static ``prompt_lens_cpu`` /
``prompt_lens_cuda`` buffers (the op's ``context_lengths``), ``kv_lens = num_cached_tokens_per_seq
+ seq_lens_kv`` into the static ``kv_lens`` / ``kv_lens_cuda``, the ``*_runtime`` views of the
first ``num_seqs`` rows, and the block offsets through
``kv_cache_manager.copy_batch_block_offsets``. The buffers are allocated once (graph-static).
"""

from __future__ import annotations

import torch

from .interface import apply_rope


class TrtllmAttentionMetadata:
    def __init__(self, *, max_num_requests: int, kv_cache_manager=None, request_ids=None, prompt_lens=None,
                 num_contexts: int = 0, seq_lens: torch.Tensor | None = None, kv_cache_params=None) -> None:
        self.max_num_requests = max_num_requests
        self.kv_cache_manager = kv_cache_manager
        self.request_ids = request_ids
        self.prompt_lens = prompt_lens
        self.num_contexts = num_contexts
        self.seq_lens = seq_lens  # CPU int tensor: new tokens per row, context rows first
        self.kv_cache_params = kv_cache_params
        self.prompt_lens_cpu = torch.zeros(max_num_requests, dtype=torch.int32)
        self.prompt_lens_cuda = torch.zeros(max_num_requests, dtype=torch.int32)
        self.kv_lens = torch.zeros(max_num_requests, dtype=torch.int32)
        self.kv_lens_cuda = torch.zeros(max_num_requests, dtype=torch.int32)
        self.kv_cache_block_offsets = None
        if kv_cache_manager is not None:
            self.kv_cache_block_offsets = torch.zeros(kv_cache_manager.num_pools, max_num_requests, 2,
                                                      kv_cache_manager.max_blocks_per_seq, dtype=torch.int32)

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def seq_lens_kv(self) -> torch.Tensor:
        return self.seq_lens

    def prepare(self) -> None:
        n = self.num_seqs
        self.prompt_lens_cpu[:n].copy_(torch.tensor(self.prompt_lens, dtype=torch.int32))
        self.prompt_lens_cuda[:n].copy_(self.prompt_lens_cpu[:n], non_blocking=True)
        cached = torch.tensor(self.kv_cache_params.num_cached_tokens_per_seq, dtype=torch.int32)
        kv_lens = cached + self.seq_lens_kv.to(torch.int32)
        self.kv_lens[:n].copy_(kv_lens + self.kv_cache_params.num_extra_kv_tokens)
        self.kv_lens_cuda[:n].copy_(self.kv_lens[:n], non_blocking=True)
        self.prompt_lens_cpu_runtime = self.prompt_lens_cpu[:n]
        self.prompt_lens_cuda_runtime = self.prompt_lens_cuda[:n]
        self.kv_lens_runtime = self.kv_lens_cuda[:n]
        if self.kv_cache_manager is not None:
            self.kv_cache_manager.copy_batch_block_offsets(self.kv_cache_block_offsets, self.request_ids, 1,
                                                           self.num_contexts, n)


class TrtllmAttention:
    Metadata = TrtllmAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 quant_config=None, q_scaling: float | None = None, pos_embd_params=None, **kwargs) -> None:
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.pos_embd_params = pos_embd_params
        self.rotated_q: torch.Tensor | None = None
        # TrtllmAttention.__init__ / update_quant_config (attention_backend/trtllm.py, index id
        # 3771944625): one dequantization scale per layer, 1.0 until a calibrated checkpoint's
        # kv_cache_scaling_factor is loaded into it (value = FP8 code x kv_scale_quant_orig).
        self.kv_cache_scaling_factor = torch.ones(1, dtype=torch.float32)
        self.kv_scale_quant_orig = self.kv_cache_scaling_factor
        self.kv_scale_orig_quant = 1.0 / self.kv_cache_scaling_factor
        self.has_fp8_kv_cache = quant_config is not None and quant_config.layer_quant_mode.has_fp8_kv_cache()

    @classmethod
    def support_fused_rope(cls) -> bool:
        return True

    @classmethod
    def support_fused_qkv(cls) -> bool:
        return True

    def forward(self, q, k, v, metadata, **kwargs) -> torch.Tensor:
        width = self.num_heads * self.head_dim
        queries = (q[..., :width] if k is None else q).reshape(q.shape[0], self.num_heads, self.head_dim)
        positions = []
        if self.pos_embd_params is not None:  # fused RoPE: the op rotates, by physical positions
            lens = metadata.seq_lens.tolist()
            for row in range(metadata.num_seqs):
                past = int(metadata.kv_lens[row]) - lens[row]
                positions += range(past, past + lens[row])
            queries = apply_rope(queries, torch.tensor(positions), self.pos_embd_params.rope_theta)
        self.rotated_q = queries
        if metadata.kv_cache_block_offsets is not None and metadata.kv_cache_manager is not None:
            kv_width = self.num_kv_heads * self.head_dim
            keys = q[..., width : width + kv_width] if k is None else k
            values = q[..., width + kv_width : width + 2 * kv_width] if k is None else v
            keys = keys.reshape(q.shape[0], self.num_kv_heads, self.head_dim)
            if self.pos_embd_params is not None:
                keys = apply_rope(keys, torch.tensor(positions), self.pos_embd_params.rope_theta)
            self._write_kv(metadata, keys, values.reshape(q.shape[0], self.num_kv_heads, self.head_dim))
        return torch.zeros(q.shape[0], width, dtype=q.dtype)

    def _write_kv(self, metadata, keys: torch.Tensor, values: torch.Tensor) -> None:
        manager = metadata.kv_cache_manager
        local = manager.layer_offsets[self.layer_idx]
        pool_index, index = manager.kv_cache_pool_mapping[local].tolist()
        per_block = int((manager.kv_cache_pool_mapping[:, 0] == pool_index).sum()) * manager.kv_factor
        layer = manager.get_buffers(self.layer_idx, kv_layout="HND")  # [P, kv, H, tpb, D]
        tpb, start = manager.tokens_per_block, 0
        if layer.dtype == torch.float8_e4m3fn:  # the kernels store codes: value x kv_scale_orig_quant
            keys, values = ((x.float() * self.kv_scale_orig_quant).clamp(-448, 448) for x in (keys, values))
        for row, length in enumerate(metadata.seq_lens.tolist()):
            kv_len = int(metadata.kv_lens[row])
            for i, position in enumerate(range(kv_len - length, kv_len)):
                block = int(metadata.kv_cache_block_offsets[pool_index, row, 0, position // tpb]) // per_block
                layer[block, 0, :, position % tpb] = keys[start + i].to(layer.dtype)
                layer[block, manager.kv_factor - 1, :, position % tpb] = values[start + i].to(layer.dtype)
            start += length
