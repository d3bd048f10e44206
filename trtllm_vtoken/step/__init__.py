# SPDX-License-Identifier: Apache-2.0
"""The one batched vToken step every host calls per decode iteration (``DecodeStep``)."""

from __future__ import annotations

from trtllm_vtoken.step.config import StepConfig, StepStats
from trtllm_vtoken.step.core import resolve_impl
from trtllm_vtoken.step.io import StepInput, StepOutput
from trtllm_vtoken.step.requests import DEFAULT
from trtllm_vtoken.step.step import DecodeStep

__all__ = ["DEFAULT", "DecodeStep", "StepConfig", "StepInput", "StepOutput", "StepStats", "resolve_impl"]
