# SPDX-License-Identifier: Apache-2.0
"""Doubles of TensorRT-LLM 1.2's ``trtllm-build`` runtime: ``ModelRunner`` and
``GenerationSession`` with a paged KV cache and the GPT attention plugin, and the engine itself.

What each imitates (read, not copied):

* ``GenerationSessionDouble12`` - ``tensorrt_llm/runtime/generation.py`` as stored in the index
  for NVIDIA/TensorRT-LLM (its 2025 copy with ``PoolsKVCacheManager``; the same functions in
  HuiGao-NV/TensorRT-LLM@195839a73571888fc1236254c12fa6db7a815920): ``_get_num_paged_blocks``
  (batch x beam x ceil(window / tpb) blocks), ``setup`` (max_seq_length = context + new tokens;
  the window defaults to it and is capped by it; the pool is allocated with
  ``_get_num_paged_blocks``, in ``torch.int8`` when the engine quantizes its KV cache
  (``quant_mode.has_kv_cache_quant()``), else in the session's dtype: ``generation.py`` ``setup``,
  index id 680446581), ``decode`` (one PoolsKVCacheManager per call, every sequence added
  with the *longest* context length), ``handle_per_step`` (context tensors at step 0; run; if
  not the last step: manager ``step([False] * batch)``, ``get_block_offsets``,
  ``_get_next_step_shape_buffer``, ``_set_tensors`` on the other ping-pong context; then the
  decoder; ``step([True] * batch)`` at the end), ``_get_next_step_shape_buffer``
  (``host_past_key_value_lengths`` = [max_context_length + step] * batch,
  ``sequence_length`` = the session's ``sequence_length_buffer``, offsets reshaped to
  [pools, batch * beam, 2, max_blocks]), ``sequence_length_buffer = context_lengths`` after the
  context step. The dynamic decoder (greedy here, top_k=1) writes each new token into
  ``output_ids`` at the sequence's length and grows ``sequence_length_buffer`` in place for
  unfinished sequences (the arguments ``handle_per_step`` passes it).
* ``RuntimeTensorDouble12`` - ``RuntimeTensor.from_torch(name, data, override_shape)``: keeps the
  torch tensor; the engine reads the bound memory when it runs (so in-place updates after binding,
  like the decoder's, are seen).
* ``EngineDouble12`` - the engine's GPT attention plugin, generation phase: the new token of
  sequence b is rotated by ``tlength = sequence_length[b] - 1``, its K/V written at that position
  and attention spans positions [0, tlength] (``decoderMaskedMultiheadAttentionTemplate.h``, as
  recorded in shared/reference/trtllm.md section 2.2); context phase: prompt token j at position j;
  blocks addressed through ``kv_cache_block_offsets`` (entry = block * layers_in_pool * 2 + field,
  the layer's own offset added from ``host_kv_cache_pool_mapping``). The maths is the reference
  runtime's Llama weights, so outputs can be compared with it; its RoPE is the plugin's own
  (``plugin_rope_double12.PluginRope``: the float32 (cos, sin) table TensorRT-LLM builds for the
  plugin, independent of ``reclaim/rope.py``). An engine built with
  StreamingLLM (``position_shift``: the plugin's ``pos_shift_enabled``, from
  ``plugin_config.streamingllm`` in ``functional.py`` ``gpt_attention``, index id 32556461248)
  caches every key WITHOUT RoPE (``applyBiasRopeUpdateKVCache``: ``k_to_cache = POS_SHIFT ?
  k_wo_pos : k``, index id 6090785109; the generation kernel stores ``k_wo_pos`` too, index id
  159071672) and, before attending, rotates each cached key by its index in the cache into a
  buffer of the cache dtype (``shiftKCache``: ``token_pos_idx = blockIdx.x``, index id
  569973755; launched from ``gptAttentionCommon.cpp`` when ``mPosShiftEnabled``, index id
  441861056), which the kernel reads instead of the cache.
* ``ModelRunnerDouble12`` - ``tensorrt_llm/runtime/model_runner.py`` at commit
  0243026ffeb359ec54dba338fd6545692a5a722d: ``_check_inputs`` (RuntimeError when the longest
  input + max_new_tokens exceeds ``max_seq_len``), ``generate`` (packed inputs, ``setup`` with
  the sampling config's ``max_attention_window_size``, then ``decode``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.integration.trtllm_blocks_double12 import (
    GenerationSequenceDouble12,
    MemoryPoolsAllocatorDouble12,
    PoolsKVCacheManagerDouble12,
)
from tests.integration.plugin_rope_double12 import PluginRope
from trtllm_vtoken.runtime.model import LlamaForCausalLM


class RuntimeTensorDouble12:
    def __init__(self, name: str, data: torch.Tensor, shape) -> None:
        self._name, self._torch_tensor, self._shape = name, data, list(shape)

    @staticmethod
    def from_torch(name: str, data: torch.Tensor, override_shape=None) -> RuntimeTensorDouble12:
        assert isinstance(data, torch.Tensor), f"data {name} is {type(data)}"
        return RuntimeTensorDouble12(name, data.contiguous(), override_shape or data.shape)

    def to_torch(self) -> torch.Tensor:
        return self._torch_tensor

    @property
    def shape(self):
        return self._shape


class EngineDouble12:
    """A Llama engine with the GPT attention plugin and a paged KV cache, on the CPU."""

    def __init__(self, model: LlamaForCausalLM, position_shift: bool = False) -> None:
        self.model, self.cfg, self.position_shift = model, model.config, position_shift
        self.pools: list[torch.Tensor] = []
        self.rope = PluginRope(self.cfg.max_position_embeddings, self.cfg.rope.rotary_dim, self.cfg.rope_theta,
                               dict(self.cfg.rope_scaling))

    def run(self, bound: dict[str, RuntimeTensorDouble12]) -> torch.Tensor:
        """Executes one step on the bound tensors; returns the last token's logits per sequence."""
        t = {name: tensor.to_torch() for name, tensor in bound.items()}
        pool = self.pools[0].view(-1, *self.pools[0].shape[3:])  # [blocks * layers * 2, heads, tpb, dim]
        tpb, layers = self.pools[0].shape[4], self.pools[0].shape[1]
        offsets = t["kv_cache_block_offsets"][0]  # [batch, 2, max_blocks]
        context = bool((t["host_request_types"] == 0).all())
        if context:
            lengths = t["host_context_lengths"].tolist()
            starts = [0] * len(lengths)
        else:
            lengths = t["sequence_length"].tolist()
            assert all(h >= n - 1 for h, n in zip(t["host_past_key_value_lengths"].tolist(), lengths)), \
                "host_past_key_value_lengths below a sequence's cached length"
            starts = [n - 1 for n in lengths]  # tlength: the new token's position
        ids = t["input_ids"].view(-1)
        logits, first = [], 0
        with torch.no_grad():
            for b, (start, end) in enumerate(zip(starts, lengths)):
                n_new = end - start
                x = self.model.model.embed_tokens(ids[first:first + n_new])[None]
                first += n_new
                positions = torch.arange(start, end)
                if end > offsets.shape[-1] * tpb:
                    raise IndexError(f"sequence {b}: length {end} beyond its block-offsets row")
                k_rows = offsets[b, 0, positions // tpb].long()
                if not torch.equal(offsets[b, 1, : -(-end // tpb)].long(), offsets[b, 0, : -(-end // tpb)].long() + 1):
                    raise ValueError(f"sequence {b}: V offsets are not K offsets + 1")
                all_rows = offsets[b, 0, torch.arange(end) // tpb].long()
                for layer_idx, layer in enumerate(self.model.model.layers):
                    h = layer.input_layernorm(x)
                    q, k, v = self._project(layer, h)
                    q = self.rope.rotate(q, positions)
                    cached = k if self.position_shift else self.rope.rotate(k, positions)
                    row = 2 * layer_idx  # the layer's K half inside a block (pool mapping: one pool)
                    pool[k_rows + row, :, positions % tpb] = cached[0].to(pool.dtype)
                    pool[k_rows + row + 1, :, positions % tpb] = v[0].to(pool.dtype)
                    keys = pool[all_rows + row, :, torch.arange(end) % tpb].float()      # [end, heads, dim]
                    if self.position_shift:  # each key turned by its slot in the cache, in the cache dtype
                        keys = self.rope.rotate(keys, torch.arange(end))
                        keys = keys.to(pool.dtype).float()
                    values = pool[all_rows + row + 1, :, torch.arange(end) % tpb].float()
                    out = self._attend(q[0], keys, values, positions)
                    x = x + layer.self_attn.o_proj(out.flatten(1))[None]
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
                logits.append(self.model.lm_head(self.model.model.norm(x[:, -1]))[0])
        assert layers == len(self.model.model.layers)
        return torch.stack(logits)

    def _project(self, layer, h):
        cfg, attn = self.cfg, layer.self_attn
        shape = h.shape[:2]
        return (attn.q_proj(h).view(*shape, cfg.num_attention_heads, cfg.head_dim),
                attn.k_proj(h).view(*shape, cfg.num_key_value_heads, cfg.head_dim),
                attn.v_proj(h).view(*shape, cfg.num_key_value_heads, cfg.head_dim))

    def _attend(self, q, keys, values, positions):
        """q [T, Hq, D] at ``positions``; keys/values [L, Hkv, D]: causal attention over [0, L)."""
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("thd,lhd->htl", q.float(), keys) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.arange(keys.shape[0])[None, None] > positions[None, :, None], float("-inf"))
        return torch.einsum("htl,lhd->thd", torch.softmax(scores, -1), values)


class _RuntimeDouble12:
    """``_Runtime``: the context profile and two ping-pong generation contexts, each a binding of
    names to RuntimeTensors (``_set_tensors``); ``_run`` executes the engine on one of them."""

    def __init__(self, engine: EngineDouble12) -> None:
        self.engine = engine
        self.ctx_context, self.context_0, self.context_1 = {}, {}, {}
        self.ctx_context = self.context_1  # one optimization profile: step 0 runs context_1

    def _set_tensors(self, context: dict, tensors: dict) -> None:
        context.update(tensors)

    def _run(self, context: dict) -> torch.Tensor:
        return self.engine.run(context)


@dataclass
class SamplingConfigDouble12:
    end_id: int
    pad_id: int
    max_new_tokens: int = 20
    num_beams: int = 1
    max_attention_window_size: int | None = None
    sink_token_length: int | None = None


class GenerationSessionDouble12:
    def __init__(self, model: LlamaForCausalLM, tokens_per_block: int, dtype: torch.dtype = torch.float32,
                 kv_cache_quant: bool = False, position_shift: bool = False) -> None:
        self.runtime = _RuntimeDouble12(EngineDouble12(model, position_shift))
        self.tokens_per_block, self.device = tokens_per_block, torch.device("cpu")
        self.dtype, self.kv_cache_quant = dtype, kv_cache_quant
        self.num_attn_layers, self.cfg = model.config.num_hidden_layers, model.config
        self.bound_history: list[dict[str, torch.Tensor]] = []  # what each next step was bound to
        self.generation_logits: list[torch.Tensor] = []

    def _get_num_paged_blocks(self, max_attention_window_size, sink_token_length):
        max_blocks_per_seq = math.ceil(max_attention_window_size / self.tokens_per_block)
        return self.batch_size * self.beam_width * max_blocks_per_seq, max_blocks_per_seq

    def setup(self, batch_size, max_context_length, max_new_tokens, beam_width=1, max_attention_window_size=None,
              sink_token_length=None, **kwargs):
        self.batch_size, self.beam_width, self.max_new_tokens = batch_size, beam_width, max_new_tokens
        self.max_seq_length = max_context_length + max_new_tokens
        window = max_attention_window_size or self.max_seq_length
        self.max_attention_window_size = min(window, self.max_seq_length)
        self.sink_token_length = sink_token_length or 0
        num_blocks, _ = self._get_num_paged_blocks(self.max_attention_window_size, self.sink_token_length)
        self._memory_pool_allocator = MemoryPoolsAllocatorDouble12(num_blocks, self.tokens_per_block, self.cfg.head_dim)
        kv_cache_type = torch.int8 if self.kv_cache_quant else self.dtype
        self._memory_pool_allocator.allocate(kv_cache_type, MemoryPoolsAllocatorDouble12.prepare_num_kv_heads_per_layer(
            self.cfg.num_key_value_heads, self.num_attn_layers))
        self.runtime.engine.pools = self._memory_pool_allocator._pool_pointers
        self.sequence_length_buffer = torch.ones(batch_size, dtype=torch.int32)

    def decode(self, input_ids, context_lengths, sampling_config):
        batch, max_ctx = len(context_lengths), int(context_lengths.max())
        num_blocks, max_blocks = self._get_num_paged_blocks(self.max_attention_window_size, self.sink_token_length)
        self.pools_kv_cache_manager = PoolsKVCacheManagerDouble12(
            self._memory_pool_allocator.pools_metadata, max_blocks, num_blocks, self.tokens_per_block,
            self.cfg.head_dim, max_attention_window_size=self.max_attention_window_size, beam_width=1,
            sink_token_len=self.sink_token_length)
        for b in range(batch):
            self.pools_kv_cache_manager.add_sequence(GenerationSequenceDouble12(b, b), max_ctx)
        self.output_ids = torch.full((batch, 1, self.max_seq_length), sampling_config.end_id, dtype=torch.int32)
        for b, row in enumerate(torch.split(input_ids, context_lengths.tolist())):
            self.output_ids[b, 0, : len(row)] = row
        self.new_tokens = torch.zeros(batch, 1, dtype=torch.int32)
        self.finished = torch.zeros(batch, dtype=torch.bool)
        self.end_id = sampling_config.end_id
        for step in range(self.max_new_tokens):
            if self.handle_per_step(step=step, batch_size=batch, max_context_length=max_ctx,
                                    input_ids=input_ids, context_lengths=context_lengths):
                break
        return self.output_ids

    def handle_per_step(self, *, step, batch_size, max_context_length, input_ids, context_lengths) -> bool:
        host_context_lengths = context_lengths.cpu()
        if step == 0:
            host_offsets = self.pools_kv_cache_manager.get_block_offsets(beam_width=1)
            context = self.runtime.ctx_context
            self.runtime._set_tensors(context, self._shape_buffer(
                input_ids, context_lengths.clone(), host_context_lengths, host_offsets.to(self.device), host_offsets,
                request_type=0))
        else:
            context = self.runtime.context_0 if step % 2 else self.runtime.context_1
        logits = self.runtime._run(context)
        if step == 0:
            self.sequence_length_buffer = context_lengths.detach().clone()
        if step != self.max_new_tokens - 1:
            self.pools_kv_cache_manager.step([False] * batch_size)
            host_offsets = self.pools_kv_cache_manager.get_block_offsets(1)
            next_context = self.runtime.context_1 if step % 2 else self.runtime.context_0
            tensors = self._get_next_step_shape_buffer(
                batch_size, 1, max_context_length, step, context_lengths, host_context_lengths, None, None, None, None,
                None, host_offsets.to(self.device), host_offsets)
            self.runtime._set_tensors(next_context, tensors)
            self.bound_history.append({name: t.to_torch().clone() for name, t in tensors.items()})
        should_stop = self._decode_token(logits)
        if step >= self.max_new_tokens - 1 or should_stop:
            self.pools_kv_cache_manager.step([True] * batch_size)
        return should_stop

    def _get_next_step_shape_buffer(self, batch_size, beam_width, max_context_length, step, context_lengths,
                                    host_context_lengths, position_ids, last_token_ids, attention_mask,
                                    cross_attention_mask, cache_indirection, kv_cache_block_offsets,
                                    host_kv_cache_block_offsets, *args, **kwargs):
        tensors = self._shape_buffer(self.new_tokens, context_lengths.clone(), host_context_lengths.clone(),
                                     kv_cache_block_offsets, host_kv_cache_block_offsets, request_type=1)
        tensors["host_past_key_value_lengths"] = RuntimeTensorDouble12.from_torch(
            "host_past_key_value_lengths", torch.tensor([max_context_length + step] * batch_size, dtype=torch.int32))
        tensors["sequence_length"] = RuntimeTensorDouble12.from_torch(
            "sequence_length", self.sequence_length_buffer, override_shape=(batch_size,))
        return tensors

    def _shape_buffer(self, input_ids, context_lengths, host_context_lengths, offsets, host_offsets, request_type):
        shape = [offsets.shape[0], offsets.shape[1] * offsets.shape[2], *offsets.shape[3:]]
        pack = RuntimeTensorDouble12.from_torch
        return {"input_ids": pack("input_ids", input_ids), "context_lengths": pack("context_lengths", context_lengths),
                "host_context_lengths": pack("host_context_lengths", host_context_lengths),
                "host_request_types": pack("host_request_types", torch.full_like(host_context_lengths, request_type)),
                "kv_cache_block_offsets": pack("kv_cache_block_offsets", offsets.view(shape)),
                "host_kv_cache_block_offsets": pack("host_kv_cache_block_offsets", host_offsets.view(shape)),
                "sequence_length": pack("sequence_length", context_lengths),
                "host_past_key_value_lengths": pack("host_past_key_value_lengths", host_context_lengths.clone())}

    def _decode_token(self, logits: torch.Tensor) -> bool:
        """The dynamic decoder, greedy: new tokens in place, appended at each unfinished sequence's
        length, which then grows by one; True when every sequence has finished."""
        self.generation_logits.append(logits.clone())
        tokens = logits.argmax(-1).to(torch.int32)
        self.new_tokens.copy_(tokens[:, None])
        for b, token in enumerate(tokens.tolist()):
            if not self.finished[b]:
                self.output_ids[b, 0, int(self.sequence_length_buffer[b])] = token
                self.sequence_length_buffer[b] += 1
                self.finished[b] = token == self.end_id
        return bool(self.finished.all())


class ModelRunnerDouble12:
    def __init__(self, session: GenerationSessionDouble12, max_batch_size: int, max_input_len: int,
                 max_seq_len: int, max_beam_width: int = 1) -> None:
        self.session, self.max_batch_size, self.max_input_len = session, max_batch_size, max_input_len
        self.max_seq_len, self.max_beam_width = max_seq_len, max_beam_width

    def _check_inputs(self, batch_input_ids, sampling_config) -> None:
        longest = max(len(x) for x in batch_input_ids)
        if len(batch_input_ids) > self.max_batch_size:
            raise RuntimeError(f"Input batch size ({len(batch_input_ids)}) exceeds the engine or specified limit")
        if longest > self.max_input_len:
            raise RuntimeError(f"Maximum input length ({longest}) exceeds the engine or specified limit")
        if longest + sampling_config.max_new_tokens > self.max_seq_len:
            raise RuntimeError(f"Maximum input length ({longest}) + maximum new tokens "
                               f"({sampling_config.max_new_tokens}) exceeds the engine or specified limit "
                               f"({self.max_seq_len})")

    def generate(self, batch_input_ids, sampling_config=None, **kwargs):
        config = sampling_config or SamplingConfigDouble12(end_id=kwargs.pop("end_id"), pad_id=kwargs.pop("pad_id"))
        for key, value in kwargs.items():
            setattr(config, key, value)
        self._check_inputs(batch_input_ids, config)
        lengths = torch.tensor([len(x) for x in batch_input_ids], dtype=torch.int32)
        self.session.setup(batch_size=len(batch_input_ids), max_context_length=int(lengths.max()),
                           max_new_tokens=config.max_new_tokens, beam_width=config.num_beams,
                           max_attention_window_size=config.max_attention_window_size,
                           sink_token_length=config.sink_token_length)
        packed = torch.cat([x.to(torch.int32) for x in batch_input_ids])
        return self.session.decode(packed, lengths, config)
