# SPDX-License-Identifier: Apache-2.0
"""Installs vToken into TensorRT-LLM's PyTorch backend (1.2.1), inside the executor worker.

Four patches, each found by feature detection; a missing hook is a RuntimeError naming it (the
module layout moved in 2026 releases: ``attention_backend`` -> ``attention/backends``,
``resource_manager.py`` -> ``kv_cache/``):

    _util.get_kv_cache_manager_cls   returns VTokenKVCacheManager where it would return KVCacheManager
    TrtllmAttention.Metadata         VTokenAttentionMetadata: physical kv_lens (metadata.py)
    TrtllmAttention.support_fused_rope   False: RoPE from logical position ids, never re-rotated
    TrtllmAttention.forward          records decode queries and prefill mass for H2O / Scissorhands
                                     (scores.py)
"""

from __future__ import annotations

import importlib
from types import ModuleType

_installed: list[str] = []

_MODULES = {
    "resource_manager": ("tensorrt_llm._torch.pyexecutor.resource_manager",),
    "util": ("tensorrt_llm._torch.pyexecutor._util",),
    "trtllm_attention": ("tensorrt_llm._torch.attention_backend.trtllm",
                         "tensorrt_llm._torch.attention.backends.trtllm"),
}


def _module(role: str) -> ModuleType:
    for name in _MODULES[role]:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError(f"TensorRT-LLM has none of {list(_MODULES[role])}: vToken targets 1.2.1")


def _require(owner, name: str):
    if not hasattr(owner, name):
        raise RuntimeError(f"TensorRT-LLM's {getattr(owner, '__name__', owner)} has no {name!r}: "
                           "vToken targets 1.2.1 (see the README's compatibility notes)")
    return getattr(owner, name)


def record_queries(attention, q, k, metadata) -> None:
    """What the patched ``TrtllmAttention.forward`` adds, for H2O / Scissorhands: the decode rows'
    rotated queries go to the manager's recorder, and each context row's prefill mass of this
    layer is added to it.

    ``TrtllmAttention`` supports fused QKV, so ``Attention.convert_qkv`` hands it one tensor
    ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]`` with ``k`` and ``v`` None, after
    RoPE (unfused RoPE is applied before the fusion): the queries are its first
    ``num_heads * head_dim`` columns, the keys the next ``num_kv_heads * head_dim``. With separate
    tensors ``q`` and ``k`` are the queries and keys. Context tokens come first, row by row
    (``metadata.seq_lens``); a batch with context rows is never graph-captured.
    """
    manager = getattr(metadata, "kv_cache_manager", None)
    queries = getattr(manager, "vtoken_queries", None)
    if queries is None or not manager.vtoken.needs_attention:
        return
    width, kv_width = attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
    if k is None:
        q, k = q[..., :width], q[..., width : width + kv_width]
    num_contexts = metadata.num_contexts
    queries.record(attention.layer_idx, q, metadata.num_seqs - num_contexts)
    start = 0
    for row, length in enumerate(metadata.seq_lens[:num_contexts].tolist() if num_contexts else []):
        rows = slice(start, start + length)
        queries.add_prefill(row, q[rows].reshape(length, attention.num_heads, attention.head_dim),
                            k[rows].reshape(length, attention.num_kv_heads, attention.head_dim))
        start += length


def install() -> list[str]:
    """Applies the patches once per process; returns what was patched. RuntimeError if TensorRT-LLM
    is absent or lacks a hook."""
    if _installed:
        return list(_installed)
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise RuntimeError(f"tensorrt_llm is not importable: {exc}") from None
    from trtllm_vtoken.integration.trtllm.manager import build_manager_class
    from trtllm_vtoken.integration.trtllm.metadata import build_metadata_class

    resource_manager, util, attention = (_module(r) for r in ("resource_manager", "util", "trtllm_attention"))
    base_manager = _require(resource_manager, "KVCacheManager")
    manager_cls = build_manager_class(base_manager)
    original_factory = _require(util, "get_kv_cache_manager_cls")

    def get_kv_cache_manager_cls(*args, **kwargs):
        cls = original_factory(*args, **kwargs)
        if cls is not base_manager:
            raise RuntimeError(f"vToken extends KVCacheManager; this model asks for {cls.__name__} "
                               "(sparse attention, Mamba hybrids and KVCacheManagerV2 are not supported)")
        return manager_cls

    util.get_kv_cache_manager_cls = get_kv_cache_manager_cls
    backend = _require(attention, "TrtllmAttention")
    backend.Metadata = build_metadata_class(_require(backend, "Metadata"))
    backend.support_fused_rope = classmethod(lambda cls: False)
    original_forward = _require(backend, "forward")

    def forward(self, q, k, v, metadata, *args, **kwargs):
        record_queries(self, q, k, metadata)
        return original_forward(self, q, k, v, metadata, *args, **kwargs)

    backend.forward = forward
    _installed.extend([
        f"tensorrt_llm {getattr(tensorrt_llm, '__version__', '?')}",
        f"{util.__name__}.get_kv_cache_manager_cls -> {manager_cls.__qualname__}",
        f"{backend.__name__}.Metadata -> {backend.Metadata.__qualname__}",
        f"{backend.__name__}.support_fused_rope -> False",
        f"{backend.__name__}.forward records decode queries and prefill attention mass",
    ])
    return list(_installed)
