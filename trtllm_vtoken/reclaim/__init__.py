# SPDX-License-Identifier: Apache-2.0
"""Reclamation: eligibility, admission, planning (dense/lazy), copy, invariants, orchestration."""

from __future__ import annotations

from trtllm_vtoken.reclaim.admission import AdmissionConfig, AdmissionController
from trtllm_vtoken.reclaim.backend import ReclaimBackend, ReclaimStats
from trtllm_vtoken.reclaim.config import ReclaimConfig
from trtllm_vtoken.reclaim.plan import RelocationPlan
from trtllm_vtoken.reclaim.planner import PLANNERS, fragmentation, plan_dense, plan_lazy

__all__ = [
    "PLANNERS", "AdmissionConfig", "AdmissionController", "ReclaimBackend", "ReclaimConfig",
    "ReclaimStats", "RelocationPlan", "fragmentation", "plan_dense", "plan_lazy",
]
