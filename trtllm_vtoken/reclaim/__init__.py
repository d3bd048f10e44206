# SPDX-License-Identifier: Apache-2.0
"""Reclamation: admission, planning (dense/lazy), the batch table call, copy, invariants, the per-call API."""

from __future__ import annotations

from trtllm_vtoken.reclaim.admission import AdmissionConfig, AdmissionController
from trtllm_vtoken.reclaim.backend import ReclaimBackend, ReclaimStats
from trtllm_vtoken.reclaim.config import ReclaimConfig
from trtllm_vtoken.reclaim.plan import RelocationPlan
from trtllm_vtoken.reclaim.planner import fragmentation, plan_dense, plan_lazy

__all__ = [
    "AdmissionConfig", "AdmissionController", "ReclaimBackend", "ReclaimConfig",
    "ReclaimStats", "RelocationPlan", "fragmentation", "plan_dense", "plan_lazy",
]
