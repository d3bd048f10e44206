# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import os
import sys

import pytest

from tests.integration.trtllm121 import ROOT as TRTLLM121_ROOT


@pytest.fixture
def trtllm121(monkeypatch):
    """The 1.2.1 double importable as ``tensorrt_llm`` in this process; the environment, the
    modules and vToken's record of installed patches restored after."""
    from trtllm_vtoken.integration.trtllm import patches

    monkeypatch.syspath_prepend(str(TRTLLM121_ROOT))
    monkeypatch.setattr(patches, "_installed", [])
    saved = dict(os.environ)
    yield
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]
    os.environ.clear()
    os.environ.update(saved)


def cpu_runs(level: str) -> bool:
    """Whether this CPU, OS and core run the C++ mass passes' kind ``level`` ("amx",
    "avx512-bf16" or "avx512"; ``mass_cpp.ISA_LEVELS``) with nothing above it allowed."""
    import torch

    from trtllm_vtoken.integration.trtllm.mass_cpp import bf16_kind, isa_limited, prefill_kind

    with isa_limited(level):
        return (prefill_kind(torch.float32) if level == "avx512" else bf16_kind()) == level


@pytest.fixture
def isa_ceiling(request):
    """The test runs with the mass passes limited to ``request.param`` (a kind: "amx",
    "avx512-bf16", "avx512"), so that each kind this CPU has is tested on it; skipped where it
    has not. Use with ``pytest.mark.parametrize("isa_ceiling", [...], indirect=True)``."""
    from trtllm_vtoken.integration.trtllm.mass_cpp import isa_limited

    if not cpu_runs(request.param):
        pytest.skip(f"needs the C++ core on a CPU and OS with {request.param}")
    with isa_limited(request.param):
        yield request.param
