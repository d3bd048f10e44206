# SPDX-License-Identifier: Apache-2.0
"""The attention-metadata subclass: the lengths the kernels see become physical.

TensorRT-LLM's model engine hands the metadata, per step, the logical past length of every
request (``kv_cache_params.num_cached_tokens_per_seq``: for a context row the start of its
chunk, ``context_current_position``) and, for a generation row, its logical prompt length
(``prompt_lens``; a context row's is its chunk's length); its position ids stay logical, which is
what unfused RoPE rotates by. vToken makes the lengths physical:

    before super().prepare():  num_cached_tokens_per_seq[i] = logical[i] - evicted(i), every row
                               -> kv_lens = cached + new tokens: kernels attend [0, physical length),
                               and a later prompt chunk is written after the compacted earlier ones
    after  super().prepare():  generation rows: prompt_lens_cpu / _cuda[i] = prompt tokens still
                               held (<= kv_lens[i]), as RocketKV's metadata does after its prefill
                               eviction; the logical ``prompt_lens`` list is left as it was given

``prepare()`` is idempotent: a second call on the same params (same objects, values as written)
starts again from the logical values it recorded instead of subtracting twice. Captured-graph
metadata is a ``copy.copy`` of this object and inherits the override.
"""

from __future__ import annotations


def build_metadata_class(base: type) -> type:
    """The vToken metadata class over ``base`` (e.g. ``TrtllmAttentionMetadata``)."""

    class VTokenAttentionMetadata(base):
        def prepare(self) -> None:
            manager = getattr(self, "kv_cache_manager", None)
            params = getattr(self, "kv_cache_params", None)
            active = (manager is not None and hasattr(manager, "vtoken_evicted") and params is not None
                      and getattr(params, "use_cache", True))
            if active:
                self._vtoken_physical_cached(manager, params)
            super().prepare()
            if active:
                self._vtoken_physical_prompt_lens(manager)

        def _generation_rows(self):
            for i, req_id in enumerate(self.request_ids or []):
                if i >= self.num_contexts:  # generation rows
                    yield i, req_id

        def _vtoken_physical_cached(self, manager, params) -> None:
            cached = params.num_cached_tokens_per_seq
            mark = getattr(self, "_vtoken_written", None)
            if mark is not None and mark[0] is params and mark[1] is cached and list(cached) == mark[2]:
                logical = mark[3]  # this step's values were made physical already
            else:
                logical = list(cached)
            physical = list(logical)
            for i, req_id in enumerate((self.request_ids or [])[: len(logical)]):
                evicted = manager.vtoken_evicted(req_id)
                if evicted > logical[i]:
                    raise RuntimeError(f"request {req_id}: {evicted} evicted tokens exceed its "
                                       f"{logical[i]} cached ones")
                physical[i] = logical[i] - evicted
            cached[:] = physical  # in place: the list the model engine handed over
            self._vtoken_written = (params, cached, list(physical), logical)

        def _vtoken_physical_prompt_lens(self, manager) -> None:
            held = [manager.vtoken_prompt_len(req_id, self.prompt_lens[i]) for i, req_id in self._generation_rows()]
            if not held:
                return
            rows = slice(self.num_contexts, self.num_contexts + len(held))
            self.prompt_lens_cpu[rows].copy_(self.prompt_lens_cpu.new_tensor(held))
            self.prompt_lens_cuda[: self.num_seqs].copy_(self.prompt_lens_cpu[: self.num_seqs], non_blocking=True)
            if hasattr(self, "prompt_lens_cpu_runtime"):  # the views the attention op reads
                self.prompt_lens_cpu_runtime = self.prompt_lens_cpu[: self.num_seqs]
                self.prompt_lens_cuda_runtime = self.prompt_lens_cuda[: self.num_seqs]

    VTokenAttentionMetadata.__qualname__ = f"VTokenAttentionMetadata[{base.__name__}]"
    return VTokenAttentionMetadata
