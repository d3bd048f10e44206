# SPDX-License-Identifier: Apache-2.0
"""What ``VTokenKVCacheManager`` does for policies that observe attention (H2O, Scissorhands): the
rows of a batch's step, and the batch's mass, computed on the device and brought to the host.

A mixin of the manager class (``manager.py``), which owns the state it reads: ``vtoken`` (the
step and its pools), ``_vtoken_batches`` (the batches in flight and their recordings),
``_vtoken_held``, ``_vtoken_cap`` (the passes' workspace) and ``_vtoken_stream`` (marks on the
execution stream). Where each pass runs: ``mass.py``; why the copy is enqueued early:
``mass_copy.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from trtllm_vtoken.integration.trtllm.mass import decode_mass
from trtllm_vtoken.integration.trtllm.mass_copy import MassCopy
from trtllm_vtoken.integration.trtllm.state import CUDA_GRAPH_DUMMY_REQUEST_ID
from trtllm_vtoken.reclaim.upload import to_device


class ManagerMass:
    def _vtoken_written(self, prepared, through_only: bool,
                        only: set[int] | None = None) -> list[tuple[int, list[int], int, int]]:
        """(request id, its block list, tokens TensorRT-LLM allocated that the table does not
        know yet, positions the batch's forward attended to) of the batch's requests still held
        and not stepped yet (``only``: of these)."""
        step, allocated, written = self.vtoken.step, self._vtoken_batches.allocated, []
        for r in self._vtoken_unstepped(prepared):
            req_id = r.py_request_id
            if only is not None and req_id not in only:
                continue
            known = step.num_tokens(req_id) if req_id in step else 0
            new = (prepared.through[req_id] if through_only else allocated[req_id]) - known
            if through_only and new <= 0:
                continue
            attended = (step.kv_len(req_id) if req_id in step else 0) + prepared.through[req_id] - known
            written.append((req_id, self.get_cache_indices(r), new, attended))
        return written

    def _vtoken_unstepped(self, prepared) -> list:
        """The batch's requests (TensorRT-LLM's objects) still held and not stepped yet."""
        return [r for r in prepared.batch.context_requests + prepared.batch.generation_requests
                if r.py_request_id in self._vtoken_held and r.py_request_id not in prepared.stepped]

    def _vtoken_may_evict(self, prepared) -> set[int]:
        """The batch's requests, held and not stepped yet, whose step may evict once the tokens
        the launched forwards wrote have joined their tables (``VTokenState.may_evict_at``; called
        before the next batch allocates its tokens): with ``decode_decision="at_once"`` the
        overlap loop steps them before the next forward, the others in ``update_resources``
        without the next batch's token, where they evict nothing."""
        allocated = self._vtoken_batches.allocated
        req_ids = [r.py_request_id for r in self._vtoken_unstepped(prepared)
                   if r.py_request_id != CUDA_GRAPH_DUMMY_REQUEST_ID]
        evicts = self.vtoken.may_evict_at([(r, allocated[r]) for r in req_ids])
        return {r for r, e in zip(req_ids, evicts) if e}

    def _vtoken_enqueue_mass(self, prepared) -> None:
        """Enqueues the batch's mass behind its forward (called before the next forward is
        launched) and its copy to the host: ``prepared.mass``."""
        rows = [(req_id, attended, blocks) for req_id, blocks, _, attended in
                self._vtoken_written(prepared, through_only=False) if req_id != CUDA_GRAPH_DUMMY_REQUEST_ID]
        if rows:
            width = max(attended for _, attended, _ in rows)
            prepared.mass = MassCopy(rows, self._vtoken_device_mass(rows, prepared, width), self._vtoken_stream)

    def _vtoken_batch_mass(self, rows: list[tuple[int, int, list[int]]], prepared, width: int) -> np.ndarray:
        """The batch's mass [B, width] float32 on the host, zero past each row's attended
        length, for rows (request id, positions its forward attended to, block ids): the copy
        enqueued before the next forward when there was one (waiting for it only), else
        computed now and copied (nothing else is in flight: the plain loop)."""
        if prepared.mass is not None:
            return prepared.mass.rows(rows, width)
        out = self._vtoken_device_mass(rows, prepared, width)
        self._vtoken_stream.wait_all()
        return out.cpu().numpy()

    def _vtoken_device_mass(self, rows: list[tuple[int, int, list[int]]], prepared, width: int) -> torch.Tensor:
        """The mass [B, width] on the device: a prompt's as the forward summed it, the decode
        rows' recomputed from their queries for all of them at once (one pass per pool).

        A decode row with draft tokens recorded one query per token; the step takes in its token
        and the accepted drafts (``attended`` less the table's length before the step), so only
        their queries count, each over the positions it attended (causal)::

            queries   [ token | draft 1 | ... | draft a | rejected ... ]
            attended  kv - a, kv - a + 1, ..., kv         (kv: the row's attended length)
        """
        step = self.vtoken.step
        pools = step.executor.pools
        out = torch.zeros(len(rows), width, dtype=torch.float32, device=pools[0].device)
        index, query_rows, blocks, kv_lens = [], [], [], []  # one entry per decode query counted
        for i, (req_id, kv_len, block_ids) in enumerate(rows):
            kind, recorded = self._vtoken_batches.recording(prepared, req_id)
            if kind == "decode" and recorded is not None and kv_len > 0:
                counted = 1
                if recorded.shape[0] > 1:  # draft tokens: the token's and the accepted drafts' queries
                    before = step.kv_len(req_id) if req_id in step else 0
                    counted = min(max(1, kv_len - before), recorded.shape[0])
                for j in range(counted):
                    index.append(i)
                    query_rows.append(recorded[j])
                    blocks.append(block_ids)
                    kv_lens.append(kv_len - counted + 1 + j)
            elif kind == "prefill" and recorded is not None:  # a prompt: its mass was summed during the forward
                part = recorded[:kv_len]
                out[i, : len(part)] = part
        if index:
            q = torch.stack(query_rows)  # [queries, local layers, heads, dim]
            mapping = self.kv_cache_pool_mapping.tolist()  # [local layers, 2]: (pool, layer in pool)
            for pool_index, pool in enumerate(pools):  # a pool per num_kv_heads
                local = [layer for layer, (p, _) in enumerate(mapping) if p == pool_index]
                queries = q[:, local]
                if pool.element_size() == 1:  # FP8 codes: q . (code x scale) = (q x scale) . code
                    scales = torch.cat([self.vtoken_queries.kv_scale(layer) for layer in local]).to(pool.device)
                    queries = queries.float() * scales.view(1, len(local), 1, 1)
                part = decode_mass(queries, pool, blocks, kv_lens, [mapping[layer][1] for layer in local],
                                   self._vtoken_cap)
                out[:, : part.shape[1]].index_add_(0, to_device(index, torch.int64, out.device), part)
        return out
