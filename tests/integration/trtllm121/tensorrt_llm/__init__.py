# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm`` 1.2.1. Its import order is the real ``tensorrt_llm/__init__.py``'s
(index id 496567939): ``from ._utils import ...`` first, which initialises MPI (``mpi4py``), then
``from .llmapi import LLM, ...``, so ``llmapi/llm.py`` is imported by ``import tensorrt_llm``."""

from . import _utils  # noqa: F401  (MPI initialised: the spawn environment is fixed from here on)
from .llmapi.llm import LLM, SamplingParams  # noqa: F401

__version__ = "1.2.1"
