# SPDX-License-Identifier: Apache-2.0
"""Eviction policies, registered by name in ``POLICIES``. Adding one is one new file here."""

from __future__ import annotations

from trtllm_vtoken.policies import (  # noqa: F401
    h2o,
    random,
    scissorhands,
    sliding_window,
    streaming_llm,
)
from trtllm_vtoken.policies.base import (
    POLICIES,
    EvictionPolicy,
    PolicyView,
    ScorePolicy,
    make_policy,
)
from trtllm_vtoken.policies.budget import Budget
from trtllm_vtoken.policies.view import policy_view

__all__ = [
    "POLICIES", "Budget", "EvictionPolicy", "PolicyView", "ScorePolicy", "make_policy", "policy_view",
]
