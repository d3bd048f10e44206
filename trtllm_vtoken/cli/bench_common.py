# SPDX-License-Identifier: Apache-2.0
"""What every ``vtoken bench`` command shares: its ``--quick`` / ``--out`` options, loading the
model, and publishing the JSON (and PNG) of a result."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from trtllm_vtoken.cli.engine_args import add_threads_option
from trtllm_vtoken.cli.info import machine


class Size(argparse.Action):
    """A size option that ``--quick`` sets too: given on the command line, its value wins (its
    dest joins ``args.given_sizes``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given_sizes = getattr(namespace, "given_sizes", frozenset()) | {self.dest}


def add_output_options(parser: argparse.ArgumentParser, quick_help: str, run, threads: bool = True,
                       quick: dict[str, Any] | None = None) -> None:
    """The options every benchmark takes: its quick form and the output folder; ``run`` runs it.
    ``threads``: also ``--threads``, the intra-op CPU threads (``bench step``'s ``--threads`` is
    its C++ pass's own). ``quick``: dest -> its value under ``--quick``, for the size options
    (declared ``action=Size``), set before ``run`` unless given on the command line."""
    parser.add_argument("--quick", action="store_true",
                        help=quick_help + ("; a size option given explicitly wins" if quick else ""))
    parser.add_argument("--out", default="out", help="folder for the JSON (and PNG) results (default ./out)")
    if threads:
        add_threads_option(parser)
    parser.set_defaults(func=functools.partial(run_sized, run), quick_sizes=dict(quick or {}))


def run_sized(run, args: argparse.Namespace) -> int:
    """``run(args)`` with ``--quick``'s sizes in ``args`` where the command line gave none."""
    if args.quick:
        given = getattr(args, "given_sizes", frozenset())
        for dest, value in args.quick_sizes.items():
            if dest not in given:
                setattr(args, dest, value)
    return run(args)


def load_model(model: str | None):
    """(folder, model, tokenizer) for a Hugging Face Llama folder or the default model."""
    from trtllm_vtoken.runtime.checkpoint import resolve_model
    from trtllm_vtoken.runtime.model import load_llama
    from trtllm_vtoken.runtime.tokenizer import Tokenizer

    folder = resolve_model(model)
    return folder, load_llama(folder), Tokenizer(folder)


def publish(out: str, name: str, result, plot=None) -> None:
    """Writes ``<out>/<name>.json`` (a dict gets the machine added) and, given a plot function,
    the PNG."""
    from trtllm_vtoken.report import write_json

    if isinstance(result, dict):
        result["machine"] = machine()
    path = write_json(out, name, result)
    if plot is not None:
        plot(result, path.with_suffix(".png"))
        print(f"wrote {path} and {path.with_suffix('.png')}")
    else:
        print(f"wrote {path}")
