# SPDX-License-Identifier: Apache-2.0
"""``vtoken info``: versions, the active core implementation, registered names."""

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

    from trtllm_vtoken.policies import POLICIES
    from trtllm_vtoken.reclaim import PLANNERS, cuda_kernel
    from trtllm_vtoken.workloads import WORKLOADS

    print(f"trtllm_vtoken {__version__} (Python {platform.python_version()})")
    from trtllm_vtoken.core import native

    print(f"core implementation: {native.describe()}")
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"CUDA relocation kernel: {cuda_kernel.describe()}")
    print(f"numpy {numpy.__version__}")
    print(f"policies: {', '.join(POLICIES.names())}")
    print(f"compaction modes: {', '.join(PLANNERS.names())}")
    print(f"workloads: {', '.join(WORKLOADS.names())}")
    return 0


def machine() -> dict:
    """Where a benchmark ran, for its JSON."""
    import os

    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
