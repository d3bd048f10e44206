# SPDX-License-Identifier: Apache-2.0
"""The ``vtoken`` command line. It only parses arguments, builds configs and calls the library.

    vtoken info                         versions, active implementation, registries
    vtoken generate "prompt" ... [--tp N]   text generation on the reference runtime (N rank processes)
    vtoken serve                        Triton Inference Server on triton_model_repo
    vtoken bench all | core | step | host | variants | capacity | utilization | quality | overhead |
                 sweeps | sla | sharing | shift | serve | gpu | tp | threads | overlap | trtllm-mass |
                 invariance | long | spec
                                        benchmarks (tables, JSON/PNG under --out)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from trtllm_vtoken import __version__
from trtllm_vtoken.cli import bench, generate, info, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vtoken", description="vToken: token-level virtualization for reclaimable KV caches."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info.register(sub)
    generate.register(sub)
    serve.register(sub)
    bench.register(sub)
    return parser


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line on stderr, as the command's errors are (not Python's file, line and
    source line under it)."""
    print(f"vtoken: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        return run(args)


def run(args: argparse.Namespace) -> int:
    """The parsed command; one line for an error the caller can mend (exit status 2) or an interruption."""
    try:
        if hasattr(args, "intra_op_threads"):  # a command that runs a model (trtllm_vtoken/threads.py)
            from trtllm_vtoken.threads import set_threads

            set_threads(args.intra_op_threads)
        return args.func(args)
    except (ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"vtoken: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vtoken: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
