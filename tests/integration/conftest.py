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
