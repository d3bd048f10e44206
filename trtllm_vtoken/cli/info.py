# SPDX-License-Identifier: Apache-2.0
"""``vtoken info``: versions, the implementation each host's step uses, registered names."""

from __future__ import annotations

import argparse
import platform

from trtllm_vtoken import __version__


def register(sub) -> None:
    parser = sub.add_parser("info", help="show versions, the active implementation and registries")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy
    import torch

    from trtllm_vtoken.core import native
    from trtllm_vtoken.integration.trtllm import mass, mass_cpp
    from trtllm_vtoken.policies import POLICIES
    from trtllm_vtoken.reclaim import cuda_kernel
    from trtllm_vtoken.reclaim.step_batch import COMPACTIONS
    from trtllm_vtoken.workloads import WORKLOADS

    print(f"trtllm_vtoken {__version__} (Python {platform.python_version()})")
    print(f"core implementation: {native.describe()}")
    print("the step each host runs once per iteration (its token table):")
    for host, impl in step_implementations():
        print(f"  {host}: {impl}")
    print("  (cpp: every batch takes one native call for its table step and layout update, which also decides "
          "a batch that one of h2o, streaming_llm, sliding_window or no policy serves (others are decided in "
          "Python first); with background compaction the call plans and the plans commit later; the reference "
          "engine and the simulated backend run that call on the step's worker thread while they sample the "
          "batch (EngineConfig.step_overlap), the TensorRT-LLM manager at once)")
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"CUDA relocation kernel: {cuda_kernel.describe()}")
    print(f"H2O mass on CUDA pools (TensorRT-LLM manager): {mass.describe_cuda()}")
    print(f"H2O mass on CPU (TensorRT-LLM manager): {mass_cpp.describe()}")
    print(f"numpy {numpy.__version__}")
    print(f"policies: {', '.join(POLICIES.names())}")
    print(f"compaction modes: {', '.join(COMPACTIONS)}")
    print(f"workloads: {', '.join(WORKLOADS.names())}")
    return 0


def step_implementations() -> list[tuple[str, str]]:
    """(host, the implementation its step uses with its default settings): what each host's
    construction resolves ``step_impl`` to (checked against the hosts by the tests)."""
    import os

    from trtllm_vtoken.integration.trtllm.settings import ENV_VAR, VTokenSettings
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.step import resolve_impl

    engine = resolve_impl(EngineConfig().step_impl)
    trtllm = VTokenSettings.from_env() if ENV_VAR in os.environ else VTokenSettings()  # what a worker gets
    return [("reference engine (naive-evict, vtoken)", engine), ("simulated backend", engine),
            ("TensorRT-LLM manager", resolve_impl(trtllm.step_impl)),
            ("native baseline", "none: plain block lists, no token table")]


def machine() -> dict:
    """Where a benchmark ran, for its JSON."""
    import os

    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg()}  # other tenants of the machine: timings are noisier under load
