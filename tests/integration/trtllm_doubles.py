# SPDX-License-Identifier: Apache-2.0
"""Test doubles of TensorRT-LLM 1.2.1 classes, named ``*Double121``, built from the 1.2.1
signatures (``tensorrt_llm/_torch/pyexecutor/resource_manager.py``: ``KVCacheManager``;
``llm_request.py``: ``LlmRequest``; ``scheduler.py``: ``ScheduledRequests``;
``attention_backend/trtllm.py``: ``TrtllmAttentionMetadata``). They model only what vToken relies
on: a free list, ``add_sequence`` / ``add_token`` allocation (a block when the length crosses a
block boundary), ``rewind_kv_cache`` releasing the tail blocks the shorter length no longer
needs, one HND pool for all layers, and the metadata's ``kv_lens = cached + new``. Nothing of
vToken's is doubled."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KvCacheConfigDouble121:
    enable_block_reuse: bool = False
    enable_partial_reuse: bool = False
    tokens_per_block: int = 4


@dataclass
class LlmRequestDouble121:
    py_request_id: int
    prompt_len: int
    max_new_tokens: int
    is_first_context_chunk: bool = True


@dataclass
class ScheduledRequestsDouble121:
    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)


class KVCacheManagerDouble121:
    """``KVCacheManager(kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads, head_dim,
    tokens_per_block, max_seq_len, max_batch_size, mapping, dtype, ..., max_beam_width=1, ...)``."""

    def __init__(self, kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads, head_dim, tokens_per_block,
                 max_seq_len, max_batch_size, mapping=None, dtype=torch.float32, max_beam_width=1,
                 num_blocks=64, **kwargs) -> None:
        self.tokens_per_block = tokens_per_block
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
        self._blocks: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        # One pool (every layer has num_kv_heads heads): [blocks, layers, 2, heads, tpb, head_dim].
        self._pool = torch.zeros(num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim, dtype=dtype)
        self.kv_cache_pool_mapping = torch.tensor([[0, layer] for layer in range(num_layers)], dtype=torch.int32)

    # ---- BaseResourceManager -------------------------------------------------------------------
    def prepare_resources(self, scheduled_batch) -> None:
        for request in scheduled_batch.context_requests:
            if request.is_first_context_chunk:
                self._add_sequence(request.py_request_id, request.prompt_len)
        for request in scheduled_batch.generation_requests:
            self._add_token(request.py_request_id)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        return None

    def free_resources(self, request, pin_on_release=False) -> None:
        self._free.extend(self._blocks.pop(request.py_request_id))
        del self._num_tokens[request.py_request_id]

    # ---- KVCacheManager --------------------------------------------------------------------------
    def rewind_kv_cache(self, request, rewind_len: int) -> None:
        req_id = request.py_request_id
        self._num_tokens[req_id] -= rewind_len
        keep = -(-self._num_tokens[req_id] // self.tokens_per_block)
        self._free.extend(self._blocks[req_id][keep:])
        del self._blocks[req_id][keep:]

    def get_cache_indices(self, request, window_size=None) -> list[int]:
        return list(self._blocks[request.py_request_id])

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_max_resource_count(self) -> int:
        return self.num_blocks

    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor:
        layer = self._pool[:, layer_idx]  # [P, 2, H, tpb, D]
        return layer if kv_layout == "HND" else layer.transpose(2, 3)

    # ---- C++ impl behaviour ----------------------------------------------------------------------
    def _add_sequence(self, req_id: int, length: int) -> None:
        self._blocks[req_id], self._num_tokens[req_id] = [], 0
        for _ in range(length):
            self._add_token(req_id)

    def _add_token(self, req_id: int) -> None:
        if self._num_tokens[req_id] % self.tokens_per_block == 0:
            self._blocks[req_id].append(self._free.pop(0))
        self._num_tokens[req_id] += 1


@dataclass
class KVCacheParamsDouble121:
    num_cached_tokens_per_seq: list[int]


class TrtllmAttentionMetadataDouble121:
    """``prepare()`` turns cached counts into ``kv_lens`` (cached + new tokens per row)."""

    def __init__(self, kv_cache_manager, request_ids, num_contexts, kv_cache_params, seq_lens_kv,
                 seq_lens=None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.seq_lens = seq_lens  # CPU int tensor: new tokens per sequence, context rows first
        self.request_ids = request_ids
        self.num_contexts = num_contexts
        self.kv_cache_params = kv_cache_params
        self.seq_lens_kv = seq_lens_kv
        self.kv_lens: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    def prepare(self) -> None:
        self.kv_lens = [c + n for c, n in zip(self.kv_cache_params.num_cached_tokens_per_seq, self.seq_lens_kv)]


class TrtllmAttentionDouble121:
    """``TrtllmAttention(layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None, ...)``:
    the attributes the patched forward reads. It supports fused QKV, so ``Attention.convert_qkv``
    passes it ``q`` = [tokens, (num_heads + 2 * num_kv_heads) * head_dim] with k = v = None."""

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 **kwargs) -> None:
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads

    @classmethod
    def support_fused_qkv(cls) -> bool:
        return True


@dataclass
class CompletionOutputDouble121:
    """``tensorrt_llm.executor.result.CompletionOutput``: cumulative text and ids plus the diffs."""

    token_ids: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list:
        return self.token_ids[self._last_token_ids_len:]


class GenerationResultDouble121:
    """``generate_async(..., streaming=True)``'s result: async-iterable chunks, ``abort()``."""

    def __init__(self, pieces: list[tuple[int, str]], delay_s: float = 0.0) -> None:
        self.pieces, self.delay_s = pieces, delay_s
        self.output = CompletionOutputDouble121()
        self.outputs = [self.output]
        self.finished = False
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        import asyncio

        for i, (token, text) in enumerate(self.pieces):
            if self.aborted:
                return
            await asyncio.sleep(self.delay_s)
            out = self.output
            out._last_text_len, out._last_token_ids_len = len(out.text), len(out.token_ids)
            out.text += text
            out.token_ids.append(token)
            self.finished = i == len(self.pieces) - 1
            if self.finished:
                out.finish_reason = "length"
            yield self


class LLMDouble121:
    """``tensorrt_llm.LLM``: ``generate_async(inputs, sampling_params, streaming)`` and ``shutdown``.
    Echoes the prompt's ids back as ``max_tokens`` pieces ("<id>" each)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.results: list[GenerationResultDouble121] = []
        self.shut_down = False

    def generate_async(self, inputs, sampling_params=None, streaming=False):
        if not inputs:
            raise ValueError("empty prompt")
        ids = (list(inputs) * sampling_params.max_tokens)[: sampling_params.max_tokens]
        result = GenerationResultDouble121([(t, f"<{t}>") for t in ids], self.delay_s)
        self.results.append(result)
        return result

    def shutdown(self) -> None:
        self.shut_down = True


class SamplingParamsDouble121:
    """``tensorrt_llm.SamplingParams`` (keyword fields only)."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


class TensorrtLlmApiDouble121:
    """The ``tensorrt_llm`` module surface ``TRTLLMLoop`` reads."""

    SamplingParams = SamplingParamsDouble121
