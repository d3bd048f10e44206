# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM manager's decode mass for a batch: one padded pass (``batch_decode_attention_mass``)
against one call and one host copy per request, as the manager made them before (its
``decode_attention_mass`` from ``--before``'s tree; without it, today's pass for a batch of one).
Counts the torch operators each makes (each a kernel launch on a GPU) and times both in
alternating order.
On CPU the copies to the host are free and the einsums dominate; on a GPU each per-row ``.cpu()``
also waits for the device.

    python benchmarks/step/trtllm_mass/run.py [--before COMMIT] [--device cuda] [--batch 64] [--context 1024] [--rounds 5]

Shapes: SmolLM2-135M's attention (30 layers, 9 query heads, 3 kv heads, head_dim 64), bf16 pool,
tokens_per_block 32, lengths staggered by up to a block. Prints one JSON line per round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass

LAYERS, HEADS, KV_HEADS, DIM, TPB = 30, 9, 3, 64, 32
SCORES = "trtllm_vtoken/integration/trtllm/scores.py"


class OperatorCount(TorchDispatchMode):
    """Counts the aten operators run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def function_at(commit: str, name: str):
    """``name`` from the scores module as it was at ``commit``."""
    source = subprocess.run(["git", "show", f"{commit}:{SCORES}"], capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "scores_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("scores_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the commit whose per-row decode_attention_mass to time (git; default: "
                                          "today's pass for a batch of one)")
    parser.add_argument("--device", default="cpu", help="torch device of the pool and queries (default cpu)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    per_row_blocks = -(-(args.context + TPB) // TPB)
    pool = torch.randn(args.batch * per_row_blocks, LAYERS, 2, KV_HEADS, TPB, DIM, generator=gen).bfloat16()
    pool = pool.to(args.device)
    lists = [list(range(i * per_row_blocks, (i + 1) * per_row_blocks)) for i in range(args.batch)]
    kv_lens = [args.context + i % TPB for i in range(args.batch)]
    q = torch.randn(args.batch, LAYERS, HEADS, DIM, generator=gen).bfloat16().to(args.device)
    sync = torch.cuda.synchronize if pool.device.type == "cuda" else (lambda: None)

    def one_row(q, pool, blocks, kv_len):
        return batch_decode_attention_mass(q[None], pool, [blocks], [kv_len])[0]

    row_mass = function_at(args.before, "decode_attention_mass") if args.before else one_row

    def per_row() -> np.ndarray:
        rows = [row_mass(q[i], pool, lists[i], kv_lens[i]).cpu() for i in range(args.batch)]
        out = np.zeros((args.batch, max(kv_lens)), dtype=np.float32)
        for i, m in enumerate(rows):
            out[i, : len(m)] = m.numpy()
        return out

    def batched() -> np.ndarray:
        return batch_decode_attention_mass(q, pool, lists, kv_lens).cpu().numpy()

    counts = {}
    for name, fn in (("per_row", per_row), ("batched", batched)):
        with OperatorCount() as counter:
            counts[name] = fn()
        counts[f"{name}_operators"] = counter.count
    print(json.dumps({"before": args.before or "today", "device": str(pool.device), "batch": args.batch, "context": args.context,
                      "max_abs_difference": float(np.abs(counts.pop("per_row") - counts.pop("batched")).max()),
                      **counts, "torch_threads": torch.get_num_threads()}))
    for round_ in range(args.rounds):  # alternating, per-row first on even rounds
        order = (("per_row", per_row), ("batched", batched)) if round_ % 2 == 0 else \
            (("batched", batched), ("per_row", per_row))
        row = {"round": round_, "batch": args.batch, "context": args.context}
        for name, fn in order:
            sync()
            start = time.perf_counter()
            fn()
            row[f"{name}_ms"] = round((time.perf_counter() - start) * 1e3, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
