# SPDX-License-Identifier: Apache-2.0
"""Installs vToken into TensorRT-LLM's PyTorch backend (1.2.1), inside the executor worker.

``activate`` runs from the start-up hook (startup.py) when the worker creates its executor, before
the model is built: it reads the settings (an error if they are missing), checks the LLM arguments
and applies five patches, each found by feature detection; a missing hook is a RuntimeError naming
it (the module layout moved in 2026 releases: ``attention_backend`` -> ``attention/backends``,
``resource_manager.py`` -> ``kv_cache/``):

    _util.get_kv_cache_manager_cls   returns VTokenKVCacheManager where it would return KVCacheManager
    TrtllmAttention.Metadata         VTokenAttentionMetadata: physical kv_lens (metadata.py)
    TrtllmAttention.support_fused_rope   False: RoPE from logical position ids, never re-rotated
                                     (Attention.__init__ reads it once, when the model is built)
    TrtllmAttention.forward          records decode queries and prefill mass for H2O / Scissorhands
                                     (scores.py)
    PyTorchModelEngine.__init__      after the model is built: every attention module must have
                                     RoPE unfused, else RuntimeError naming them

Armed as "rope" ($VTOKEN_TRTLLM=rope, ``baseline_llm_args``) only the two RoPE patches go in:
TensorRT-LLM's own KV-cache manager runs, and the model engine's check writes the worker's record
(``arming.py``; armed as vToken the manager writes it).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from trtllm_vtoken.integration.trtllm.settings import VTokenSettings, check_llm_args
from trtllm_vtoken.integration.trtllm.environment import arm_mode

_installed: list[str] = []

_MODULES = {
    "model_engine": ("tensorrt_llm._torch.pyexecutor.model_engine",),
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
    (``metadata.seq_lens``); a batch with context rows is never graph-captured. A context row whose
    prompt prefix came from the reuse tree computes only the rest (``num_cached_tokens_per_seq`` of
    the row, the model engine's ``context_current_position``): its queries also attend to the
    cached prefix, whose keys are read from the pool. A later chunk of a prompt (chunked prefill)
    likewise: its queries attend to the earlier chunks' keys still held (the metadata made
    ``num_cached_tokens_per_seq`` physical), and H2O's ``prefill_window`` counts from the prompt's
    end (``vtoken_prompt_after``). Decode rows with draft tokens that the engine runs as context
    rows are decode rows here (``prompt_rows``).
    """
    manager = getattr(metadata, "kv_cache_manager", None)
    queries = getattr(manager, "vtoken_queries", None)
    if queries is None or not manager.vtoken.needs_attention:
        return
    width, kv_width = attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
    if k is None:
        q, k = q[..., :width], q[..., width : width + kv_width]
    num_contexts = prompt_rows(metadata)
    local = manager.local_layer(attention.layer_idx)
    queries.note_kv_scale(local, attention)
    queries.record(local, q, int(metadata.seq_lens[num_contexts : metadata.num_seqs].sum()))  # decode rows' tokens
    params = getattr(metadata, "kv_cache_params", None)
    cached = getattr(params, "num_cached_tokens_per_seq", None) or []
    start = 0
    for row, length in enumerate(metadata.seq_lens[:num_contexts].tolist() if num_contexts else []):
        rows = slice(start, start + length)
        past = cached[row] if row < len(cached) else 0  # a reused prefix, or the prompt's earlier chunks
        past_k = queries.dequantized(local, manager.vtoken_cached_keys(metadata.request_ids[row], attention.layer_idx,
                                                                       past)) if past else None
        queries.add_prefill(row, q[rows].reshape(length, attention.num_heads, attention.head_dim),
                            k[rows].reshape(length, attention.num_kv_heads, attention.head_dim), past_k,
                            manager.vtoken_prompt_after(metadata.request_ids[row]))
        start += length


def prompt_rows(metadata) -> int:
    """The rows of the batch that prefill a prompt (they come first). ``num_contexts`` also counts
    the decode rows with draft tokens where the model engine runs them as chunked context rows (the
    spec mode's ``extend_ctx``, which depends on the GPU); ``num_chunked_ctx_requests`` says how
    many of those it added (``_prepare_tp_inputs``, ``model_engine.py``)."""
    extended = int(getattr(metadata, "num_chunked_ctx_requests", 0) or 0)
    if not 0 <= extended <= metadata.num_contexts:
        raise RuntimeError(f"the attention metadata counts {extended} decode rows among its "
                           f"{metadata.num_contexts} context rows")
    return metadata.num_contexts - extended


def rope_fusion_problems(model) -> list[str]:
    """Names of the model's attention modules with RoPE fused (``Attention.rope_fusion`` true), or
    one line saying it has none that carries ``rope_fusion`` at all."""
    found, fused = 0, []
    for name, module in model.named_modules():
        if hasattr(module, "rope_fusion"):
            found += 1
            if module.rope_fusion:
                fused.append(name or type(module).__name__)
    return fused if found else [f"{type(model).__name__} has no attention module with a rope_fusion attribute"]


def check_rope_unfused(model) -> None:
    """RuntimeError unless every attention module rotates q/k itself from the logical position ids:
    with fused RoPE the kernel would rotate by the physical length after a compaction."""
    problems = rope_fusion_problems(model)
    if problems:
        shown = ", ".join(problems[:4]) + (f" and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise RuntimeError(f"vToken needs RoPE unfused in every attention module, but: {shown}. "
                           "TrtllmAttention.support_fused_rope must be patched before the model is built "
                           "(the start-up hook does this; is trtllm_vtoken_startup.pth in site-packages?)")


def unfused_rope_required(settings: VTokenSettings) -> bool:
    """Kept positions (the default, and the only mode the PyTorch backend's manager accepts) need
    RoPE unfused: new tokens rotated by their logical position ids."""
    return settings.positions == "keep"


def activate(llm_args=None) -> list[str]:
    """What the start-up hook runs in the worker when armed, before the executor is created: the
    settings (RuntimeError if missing), the LLM arguments' check, then ``install`` in the armed
    mode."""
    settings = VTokenSettings.from_env()
    if llm_args is not None:
        check_llm_args(llm_args)
    return install(settings, arm_mode() or "vtoken")


def install(settings: VTokenSettings | None = None, mode: str = "vtoken") -> list[str]:
    """Applies the patches of ``mode`` ("vtoken", or "rope": unfused RoPE only) once per process;
    returns what was patched. RuntimeError if TensorRT-LLM is absent or lacks a hook, if no
    settings are given and none are in the environment, or if the other mode is installed."""
    if _installed:
        if _installed[0] != f"mode {mode}":
            raise RuntimeError(f"this process has vToken installed as {_installed[0]!r}, not as mode {mode!r}")
        return list(_installed)
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise RuntimeError(f"tensorrt_llm is not importable: {exc}") from None
    settings = settings if settings is not None else VTokenSettings.from_env()
    if mode == "rope":
        done = [f"mode {mode}", f"tensorrt_llm {getattr(tensorrt_llm, '__version__', '?')}",
                *_unfuse_rope(settings, record=True)]
        _installed.extend(done)
        return list(_installed)
    if mode != "vtoken":
        raise ValueError(f"mode must be 'vtoken' or 'rope', got {mode!r}")
    from trtllm_vtoken.integration.trtllm.manager import build_manager_class
    from trtllm_vtoken.integration.trtllm.metadata import build_metadata_class

    roles = ("resource_manager", "util", "trtllm_attention", "model_engine")
    resource_manager, util, attention, model_engine = (_module(r) for r in roles)
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
    original_forward = _require(backend, "forward")

    def forward(self, q, k, v, metadata, *args, **kwargs):
        record_queries(self, q, k, metadata)
        return original_forward(self, q, k, v, metadata, *args, **kwargs)

    backend.forward = forward
    done = [
        f"mode {mode}",
        f"tensorrt_llm {getattr(tensorrt_llm, '__version__', '?')}",
        f"{util.__name__}.get_kv_cache_manager_cls -> {manager_cls.__qualname__}",
        f"{backend.__name__}.Metadata -> {backend.Metadata.__qualname__}",
        f"{backend.__name__}.forward records decode queries and prefill attention mass",
    ]
    if unfused_rope_required(settings):
        done += _unfuse_rope(settings, record=False)
    _installed.extend(done)
    return list(_installed)


def _unfuse_rope(settings: VTokenSettings, record: bool) -> list[str]:
    """``support_fused_rope`` -> False before the model is built, and the check after it; with
    ``record``, the check also writes the worker's record (mode "rope")."""
    backend = _require(_module("trtllm_attention"), "TrtllmAttention")
    engine = _require(_module("model_engine"), "PyTorchModelEngine")
    _require(backend, "support_fused_rope")
    backend.support_fused_rope = classmethod(lambda cls: False)
    original_init = engine.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        check_rope_unfused(self.model)
        if record and settings.stats_file:
            from trtllm_vtoken.integration.trtllm.arming import worker_record, write_record

            unfused = sum(1 for _, m in self.model.named_modules() if hasattr(m, "rope_fusion"))
            write_record(settings.stats_file, worker_record("rope", settings, engine.__module__,
                                                            rope_unfused_modules=unfused))

    engine.__init__ = __init__
    return [f"{backend.__name__}.support_fused_rope -> False",
            f"{engine.__qualname__}.__init__ checks that every attention module has RoPE unfused"]
