# SPDX-License-Identifier: Apache-2.0
"""vToken inside TensorRT-LLM's PyTorch backend (1.2.1): one entry for users.

    from trtllm_vtoken.integration.trtllm import vtoken_llm_args

    args = vtoken_llm_args(policy="h2o", budget=0.5)  # before `import tensorrt_llm`: every build
    from tensorrt_llm import LLM

    llm = LLM(model, **args)

``vtoken_llm_args`` returns the LLM arguments vToken needs and sends its settings to TensorRT-LLM's
executor worker (``env_overrides`` and this process's environment: call it before ``import
tensorrt_llm`` to cover builds whose worker ignores ``env_overrides``); the package's start-up hook
(``startup.py``) installs the patches in that worker before the model is built, and in this
process makes the ``LLM`` fail if its worker did not arm (``arming.py``). ``baseline_llm_args``:
the same LLM with RoPE unfused only. ``llm_args_dict`` is the same as plain values, for a Triton
``model.yaml``.

Importing this package is cheap (the start-up hook imports ``startup`` in every interpreter):
the names below load their modules on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "VTokenEngineRunner": "trtllm_vtoken.integration.trtllm.engine_runner",
    "VTokenSettings": "trtllm_vtoken.integration.trtllm.settings",
    "baseline_llm_args": "trtllm_vtoken.integration.trtllm.llm_args",
    "check_llm_args": "trtllm_vtoken.integration.trtllm.settings",
    "llm_args_dict": "trtllm_vtoken.integration.trtllm.llm_args",
    "vtoken_llm_args": "trtllm_vtoken.integration.trtllm.llm_args",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
