# SPDX-License-Identifier: Apache-2.0
"""The attention-metadata subclass: the KV length the kernels see becomes physical.

TensorRT-LLM's model engine puts the logical past length of every generation request into
``kv_cache_params.num_cached_tokens_per_seq`` (its position ids stay logical, which is what
unfused RoPE rotates by). Before the base ``prepare()`` turns these into ``kv_lens`` and copies
them into the graph-static buffers, vToken subtracts each request's evicted tokens, so kernels
attend exactly ``[0, physical length)`` of the compacted block list. Captured-graph metadata is a
``copy.copy`` of this object and inherits the override.
"""

from __future__ import annotations


def build_metadata_class(base: type) -> type:
    """The vToken metadata class over ``base`` (e.g. ``TrtllmAttentionMetadata``)."""

    class VTokenAttentionMetadata(base):
        def prepare(self) -> None:
            manager = getattr(self, "kv_cache_manager", None)
            params = getattr(self, "kv_cache_params", None)
            if manager is not None and hasattr(manager, "vtoken_evicted") and params is not None:
                cached = params.num_cached_tokens_per_seq
                for i, req_id in enumerate(self.request_ids or []):
                    if i >= self.num_contexts:  # generation rows (chunked prefill is off)
                        evicted = manager.vtoken_evicted(req_id)
                        if evicted > cached[i]:
                            raise RuntimeError(f"request {req_id}: {evicted} evicted tokens exceed its "
                                               f"{cached[i]} cached ones")
                        cached[i] -= evicted
            super().prepare()

    VTokenAttentionMetadata.__qualname__ = f"VTokenAttentionMetadata[{base.__name__}]"
    return VTokenAttentionMetadata
