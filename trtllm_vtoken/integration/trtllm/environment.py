# SPDX-License-Identifier: Apache-2.0
"""The two variables that arm vToken in a process and what their values mean.

Every module of the adapter reads them (the start-up hook to decide whether to install, the
settings to travel to the worker, the arming proof to name what was asked), so they live apart
from all of them and import nothing of the package."""

from __future__ import annotations

import os
from collections.abc import Mapping

ARM_VAR = "VTOKEN_TRTLLM"
SETTINGS_VAR = "VTOKEN_TRTLLM_SETTINGS"
ARM_VALUES = {"1": "vtoken", "rope": "rope"}
"""$VTOKEN_TRTLLM values that arm a worker, and what they install: "vtoken" (everything) or "rope"
(unfused RoPE only: TensorRT-LLM's own KV-cache manager, a baseline that differs from vToken by
vToken alone)."""


def arm_mode(environ: Mapping[str, str] | None = None) -> str | None:
    """"vtoken", "rope" or None (off). ValueError for any other value of $VTOKEN_TRTLLM."""
    value = (os.environ if environ is None else environ).get(ARM_VAR, "")
    if value in ("", "0"):
        return None
    if value not in ARM_VALUES:
        raise ValueError(f"${ARM_VAR} must be 1 (vToken on), rope (unfused RoPE only) or 0 / unset (off), "
                         f"got {value!r}")
    return ARM_VALUES[value]


def armed(environ: Mapping[str, str] | None = None) -> bool:
    """Is vToken (or its RoPE-only baseline) armed in this process?"""
    return arm_mode(environ) is not None
