# SPDX-License-Identifier: Apache-2.0
"""vToken's state as Prometheus metrics: one table of names, kinds and how to read each from an
engine. Triton's Python backend exports them (``triton_model_repo``); tests compare them with
the engine's own counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from trtllm_vtoken.runtime.engine import Engine


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Literal["gauge", "counter"]
    description: str
    read: Callable[[Engine], float]


def _step(engine: Engine, field: str) -> float:
    return float(getattr(engine.kv.step_stats, field))


def _cache(engine: Engine, field: str) -> float:
    prefix = engine.kv.prefix
    return float(getattr(prefix.cache.stats, field)) if prefix is not None else 0.0


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("vtoken_kv_blocks_retained", "gauge", "KV blocks held by requests (each shared block once)",
               lambda e: float(e.kv.pool.num_blocks - e.kv.num_available)),
    MetricSpec("vtoken_kv_blocks_cached", "gauge", "Cached prefix blocks no request holds (freed on demand)",
               lambda e: float(e.kv.prefix.cache.num_reclaimable if e.kv.prefix else 0)),
    MetricSpec("vtoken_prefix_cache_query_tokens", "counter", "Prompt tokens looked up in the prefix cache",
               lambda e: _cache(e, "query_tokens")),
    MetricSpec("vtoken_prefix_cache_hit_tokens", "counter", "Prompt tokens found cached (not prefilled)",
               lambda e: _cache(e, "hit_tokens")),
    MetricSpec("vtoken_kv_blocks_total", "gauge", "KV blocks in the pool",
               lambda e: float(e.kv.pool.num_blocks)),
    MetricSpec("vtoken_kv_utilization", "gauge", "Live tokens over slots in held blocks",
               lambda e: e.kv.usage().utilization),
    MetricSpec("vtoken_admission_headroom_blocks", "gauge",
               "Free blocks minus blocks reserved for running requests and evacuation",
               lambda e: float(e.kv.admission.available_blocks())),
    MetricSpec("vtoken_requests_running", "gauge", "Requests in the running batch",
               lambda e: float(len(e.running))),
    MetricSpec("vtoken_requests_waiting", "gauge", "Requests waiting for admission",
               lambda e: float(len(e.waiting))),
    MetricSpec("vtoken_tokens_evicted", "counter", "Tokens the eviction policy marked dead",
               lambda e: _step(e, "tokens_evicted")),
    MetricSpec("vtoken_relocations", "counter", "Request compactions committed (moves, a shorter length or freed blocks)",
               lambda e: _step(e, "compactions")),
    MetricSpec("vtoken_tokens_relocated", "counter", "Live tokens copied to new slots",
               lambda e: _step(e, "moves")),
    MetricSpec("vtoken_bytes_copied", "counter", "KV bytes moved by relocation",
               lambda e: _step(e, "bytes_copied")),
    MetricSpec("vtoken_blocks_reclaimed", "counter", "Blocks returned to the pool by reclamation",
               lambda e: _step(e, "blocks_freed")),
    MetricSpec("vtoken_requests_preempted", "counter", "Requests preempted (freed, recomputed later)",
               lambda e: float(e.stats.preemptions)),
    MetricSpec("vtoken_requests_finished", "counter", "Requests finished (not cancelled)",
               lambda e: float(e.stats.finished)),
)


POLICY_METRICS: tuple[tuple[str, str], ...] = (
    ("vtoken_policy_requests", "Requests added, by the eviction policy they run with"),
    ("vtoken_policy_tokens_evicted", "Tokens evicted, by the eviction policy that chose them"),
)
"""Counters with a ``policy`` label (a registered policy or "native"): requests choose their own
policy, and the label's values are bounded by the registry, never per request."""


def snapshot(engine: Engine) -> dict[str, float]:
    """Every metric's current value (counters are totals since the engine started)."""
    return {spec.name: spec.read(engine) for spec in METRICS}


def snapshot_by_policy(engine: Engine) -> dict[str, dict[str, float]]:
    """Per policy name: the ``POLICY_METRICS`` counters' totals."""
    requests, evicted = engine.stats.requests_by_policy, engine.kv.stats.tokens_evicted_by_policy
    return {policy: {"vtoken_policy_requests": float(requests.get(policy, 0)),
                     "vtoken_policy_tokens_evicted": float(evicted.get(policy, 0))}
            for policy in sorted(set(requests) | set(evicted))}
