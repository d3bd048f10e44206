# SPDX-License-Identifier: Apache-2.0
"""Request workloads from real text: ShareGPT-like chats and LongBench-like long documents."""

from __future__ import annotations

from trtllm_vtoken.workloads import longdoc, sharegpt  # noqa: F401
from trtllm_vtoken.workloads.base import WORKLOADS, WorkloadItem, make_workload

__all__ = ["WORKLOADS", "WorkloadItem", "make_workload"]
