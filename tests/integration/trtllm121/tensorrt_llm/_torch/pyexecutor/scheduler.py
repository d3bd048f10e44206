# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/scheduler.py`` ``ScheduledRequests``: context requests, then
generation requests (the batch order the model engine and the metadata rows follow)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequests:
    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)

    def all_requests(self) -> list:
        return self.context_requests + self.generation_requests
