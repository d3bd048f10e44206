# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm`` 1.2.1. Importing it initialises "MPI" (``_utils``), as the real
package does through ``mpi4py``."""

from . import _utils  # noqa: F401  (MPI initialised: the spawn environment is fixed from here on)

__version__ = "1.2.1"


def __getattr__(name):
    if name in ("LLM", "SamplingParams"):
        from .llmapi import llm

        return getattr(llm, name)
    raise AttributeError(name)
