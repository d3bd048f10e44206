# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/model_engine.py`` ``PyTorchModelEngine`` (1.2-era copy, index
id 707893322; id 5661567389 is an earlier, ~0.17-era copy with ``PyTorchConfig`` fields): its ``__init__`` builds the model (``self.model``), so every
``Attention.__init__`` (and its ``rope_fusion``) runs here, before the executor creator goes on to
the KV cache. The model: a tiny decoder whose attention layers are this pipeline rank's
(``mapping.pp_layers``) with their global ids, bf16; ``model.model_config`` carries
``pretrained_config``, ``attn_backend``, ``sparse_attention_config`` and ``is_generation`` as the
real ``ModelConfig`` does.

``forward(scheduled_requests, resource_manager, new_tensors_device=None)``, as the real one:
``_set_up_attn_metadata`` (one ``attn_backend.Metadata`` object for the engine's life, built from
the class attribute at that time, so a patched ``Metadata`` is the one used); ``pad_batch``
(a generation-only batch is padded to the next CUDA-graph batch size with the padding dummy
``CUDA_GRAPH_DUMMY_REQUEST_ID``, created once by ``add_dummy_requests(is_gen=True,
max_num_draft_tokens=...)`` (the spec config's ``max_total_draft_tokens``) and marked
``is_cuda_graph_dummy``); ``_prepare_tp_inputs``: a context row's ``context_chunk_size`` tokens from
``context_current_position`` on, ``num_cached_tokens_per_seq`` = that position, its prompt length
the chunk's length (``prompt_lengths.append(len(prompt_tokens))``); a generation
row's position and cached count ``max_beam_num_tokens - 1``, or ``max_beam_num_tokens`` when the
overlap loop hands the previous batch's device tokens (the token sampled last is not in the
request yet); a generation row with draft tokens (speculative decoding) carries its input token
and its drafts at the positions after it (``seq_len`` 1 + drafts), and the rows with drafts
("extend" requests, padding dummies last) come before those without; where the spec mode's
``extend_ctx(attn_backend)`` holds, ``num_contexts`` counts the rows with drafts too, their
prompt lengths are 1 + drafts, and ``num_chunked_ctx_requests`` says how many they are (0
otherwise); ``attn_metadata.prepare()``; then every attention layer on its hidden states. The
hidden state of a token is the embedding of its id (what the layers compute from it is the
double's; what the KV cache receives and where is the real op's, see ``TrtllmAttention``).

``warmup(resource_manager)``: CUDA-graph warm-up per batch size (``_create_cuda_graph_warmup_request``:
``add_dummy_requests(list(range(bs - 1)), is_gen=True)`` plus one longer dummy, a forward, then
``free_resources`` of each in ``_release_batch_context``); never ``prepare_resources`` or
``update_resources``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ..attention_backend.interface import KVCacheParams
from .llm_request import get_draft_token_length
from ..modules.attention import Attention, get_attention_backend

TINY = {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 512}
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


class DecoderModel(nn.Module):
    def __init__(self, config: dict, mapping, attn_backend: str) -> None:
        super().__init__()
        self.model_config = SimpleNamespace(pretrained_config=SimpleNamespace(**config), attn_backend=attn_backend,
                                            sparse_attention_config=None, is_generation=True)
        generator = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(config["vocab_size"], config["hidden_size"], generator=generator)
                                  .to(torch.bfloat16), requires_grad=False)
        self.layers = nn.ModuleList(
            Attention(hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
                      num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                      layer_idx=layer, attn_backend=attn_backend)
            for layer in mapping.pp_layers(config["num_hidden_layers"]))
        for layer in self.layers:
            nn.init.normal_(layer.qkv_proj.weight, std=0.3, generator=generator)


class PyTorchModelEngine:
    def __init__(self, *, model_path=None, llm_args=None, mapping=None, attn_runtime_features=None, dist=None,
                 spec_config=None, is_draft_model: bool = False, **kwargs) -> None:
        self.llm_args, self.mapping = llm_args, mapping
        self.dtype = torch.bfloat16
        self.max_seq_len = llm_args.max_seq_len or 256
        self.max_num_tokens = llm_args.max_num_tokens
        self.batch_size = llm_args.max_batch_size
        self.model = DecoderModel(dict(TINY), mapping, llm_args.attn_backend)
        self.attn_backend = get_attention_backend(llm_args.attn_backend)
        graphs = getattr(llm_args, "cuda_graph_config", None)
        sizes = getattr(graphs, "batch_sizes", None) if graphs is not None else None
        # validate_cuda_graph_config (llm_args.py): powers of two and multiples of 8 up to max_batch_size
        default = [s for s in (1, 2, 4) + tuple(range(8, 129, 8)) if s <= self.batch_size]
        self.cuda_graph_batch_sizes = sorted(sizes) if sizes else (default if graphs is not None else [])
        self.spec_config = spec_config
        self.max_total_draft_tokens = spec_config.max_total_draft_tokens if spec_config is not None else 0
        self.attn_metadata = None
        self.padding_dummy_request = None
        self.iter_counter = 0

    # ---- forward -------------------------------------------------------------------------------
    def _set_up_attn_metadata(self, kv_cache_manager):
        if self.attn_metadata is None:
            self.attn_metadata = self.attn_backend.Metadata(max_num_requests=self.batch_size,
                                                            kv_cache_manager=kv_cache_manager)
        if self.attn_metadata.kv_cache_manager is not kv_cache_manager:
            raise AssertionError("the attention metadata belongs to another KV-cache manager")
        return self.attn_metadata

    def _padded(self, scheduled_requests, kv_cache_manager) -> list:
        generation = list(scheduled_requests.generation_requests)
        if scheduled_requests.context_requests or not generation or not self.cuda_graph_batch_sizes:
            return generation
        size = next((s for s in self.cuda_graph_batch_sizes if s >= len(generation)), None)
        if size is None or size == len(generation):
            return generation
        if self.padding_dummy_request is None:
            dummies = kv_cache_manager.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID], is_gen=True,
                                                          max_num_draft_tokens=self.max_total_draft_tokens)
            if dummies is None:
                return generation
            self.padding_dummy_request = dummies[0]
            self.padding_dummy_request.is_cuda_graph_dummy = True
        return generation + [self.padding_dummy_request] * (size - len(generation))

    def forward(self, scheduled_requests, resource_manager, new_tensors_device=None, **kwargs):
        kv_cache_manager = resource_manager.get_resource_manager("kv_cache_manager")
        metadata = self._set_up_attn_metadata(kv_cache_manager)
        tokens, positions, cached, seq_lens = [], [], [], []
        for req in scheduled_requests.context_requests:
            begin = req.context_current_position
            chunk = req.get_tokens(0)[begin : begin + req.context_chunk_size]
            tokens += chunk
            positions += range(begin, begin + len(chunk))
            cached.append(begin)
            seq_lens.append(len(chunk))
        self.row_positions = list(cached)  # test view: each row's first logical position
        generation = self._padded(scheduled_requests, kv_cache_manager)
        # rows with drafts ("extend" requests, padding dummies last) before the rows without
        extend = [r for r in generation if get_draft_token_length(r) > 0 and not r.is_dummy_request] + \
            [r for r in generation if get_draft_token_length(r) > 0 and r.is_dummy_request]
        generation = extend + [r for r in generation if get_draft_token_length(r) == 0]
        extend_ctx = self.spec_config is not None and self.spec_config.spec_dec_mode.extend_ctx(self.attn_backend)
        for req in generation:
            in_flight = new_tensors_device is not None and req.py_batch_idx is not None and not req.is_dummy_request
            past = req.max_beam_num_tokens if in_flight else req.max_beam_num_tokens - 1
            drafts = list(req.py_draft_tokens)  # a padding dummy's too: every row of a graph has as many
            tokens.append(new_tensors_device.new_tokens[req.py_request_id] if in_flight else req.get_last_tokens(0))
            tokens += drafts
            positions += range(past, past + 1 + len(drafts))
            cached.append(past)
            seq_lens.append(1 + len(drafts))
            self.row_positions.append(past)
        for i, req in enumerate(list(scheduled_requests.context_requests) + generation):
            req.py_batch_idx = i
        rows = list(scheduled_requests.context_requests) + generation
        metadata.request_ids = [r.py_request_id for r in rows]
        metadata.prompt_lens = seq_lens[: len(scheduled_requests.context_requests)] + \
            [1 + get_draft_token_length(r) if extend_ctx and r in extend else r.py_prompt_len for r in generation]
        metadata.num_contexts = len(scheduled_requests.context_requests)
        metadata.num_chunked_ctx_requests = len(extend) if extend_ctx else 0
        metadata.num_contexts += metadata.num_chunked_ctx_requests
        metadata.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        metadata.kv_cache_params = KVCacheParams(use_cache=True, num_cached_tokens_per_seq=cached)
        metadata.prepare()
        hidden = self.model.embed[torch.tensor(tokens)]
        position_ids = torch.tensor(positions)
        with torch.no_grad():
            for layer in self.model.layers:
                layer.forward(position_ids, hidden, metadata)
        self.iter_counter += 1
        return {"logits": None}

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self, resource_manager) -> None:
        kv_cache_manager = resource_manager.get_resource_manager("kv_cache_manager")
        if kv_cache_manager is None:
            return
        from .scheduler import ScheduledRequests

        for batch_size in reversed(self.cuda_graph_batch_sizes):
            if kv_cache_manager.get_num_free_blocks() < batch_size:
                continue
            drafts = self.max_total_draft_tokens
            requests = kv_cache_manager.add_dummy_requests(list(range(batch_size - 1)), is_gen=True,
                                                           max_num_draft_tokens=drafts) or []
            longest = kv_cache_manager.add_dummy_requests([batch_size - 1], token_nums=[2 + drafts], is_gen=True,
                                                          max_num_draft_tokens=drafts)
            batch = ScheduledRequests(generation_requests=(longest or []) + requests)
            try:
                self.forward(batch, resource_manager)
            finally:
                for req in batch.all_requests():
                    kv_cache_manager.free_resources(req)
