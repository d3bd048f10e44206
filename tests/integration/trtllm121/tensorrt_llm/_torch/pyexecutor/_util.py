# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/_util.py`` (1.2-era copy, index id 843526953):

- ``get_kv_cache_manager_cls(model_config)``: a module function returning ``KVCacheManager``
  (sparse attention and hybrid models get other managers, not doubled: an error here);
  ``KvCacheCreator`` reads it as a module global, so a patch of the module attribute applies.
- ``KvCacheCreator.build_managers`` constructs the class with the real keywords
  (``_create_kv_cache_manager``): ``num_layers`` = the model's whole layer count (the manager
  keeps this rank's layers), ``dtype`` = the model's dtype as a ``DataType`` (BF16 here),
  ``mapping``, ``max_beam_width``, ``kv_connector_manager``... into
  ``resources["kv_cache_manager"]`` (``ResourceManagerType.KV_CACHE_MANAGER``).
"""

from __future__ import annotations

from ...bindings import CacheType, DataType
from .resource_manager import KVCacheManager


def get_kv_cache_manager_cls(model_config):
    if model_config.sparse_attention_config is not None:
        raise NotImplementedError("sparse-attention managers are not doubled")
    return KVCacheManager


class KvCacheCreator:
    def __init__(self, *, model_engine, mapping, kv_cache_config, max_seq_len: int, max_batch_size: int,
                 tokens_per_block: int, max_beam_width: int, max_num_tokens: int, kv_connector_manager=None,
                 llm_args=None, **kwargs) -> None:
        self._model_engine, self._mapping, self._kv_cache_config = model_engine, mapping, kv_cache_config
        self._max_seq_len, self._max_batch_size = max_seq_len, max_batch_size
        self._tokens_per_block, self._max_beam_width, self._max_num_tokens = tokens_per_block, max_beam_width, max_num_tokens
        self._kv_connector_manager = kv_connector_manager
        self._kv_cache_manager_cls = get_kv_cache_manager_cls(model_engine.model.model_config)

    def build_managers(self, resources: dict, estimating_kv_cache: bool = False) -> None:
        config = self._model_engine.model.model_config.pretrained_config
        resources["kv_cache_manager"] = self._kv_cache_manager_cls(
            self._kv_cache_config, CacheType.SELF, num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            tokens_per_block=self._tokens_per_block, max_seq_len=self._max_seq_len,
            max_batch_size=self._max_batch_size, mapping=self._mapping, dtype=DataType.BF16, spec_config=None,
            max_num_tokens=self._max_num_tokens, model_config=None, max_beam_width=self._max_beam_width,
            is_draft=False, kv_connector_manager=self._kv_connector_manager, sparse_attn_config=None)
