# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench trtllm-mass``: the TensorRT-LLM manager's decode attention mass for a batch, in
one padded pass (``batch_decode_attention_mass``, as the manager computes it) against one call
and one copy to the host per request (the same function for a batch of one).

It counts the torch operators each makes (each a kernel launch on a GPU) and times both in
alternating order. On a CPU the copies to the host are free and the einsums dominate; on a GPU
each per-request ``.cpu()`` also waits for the device.

Shapes: SmolLM2-135M's attention (30 layers, 9 query heads, 3 KV heads, head_dim 64), a bf16 pool
in TensorRT-LLM's layout, tokens_per_block 32, lengths staggered by up to a block.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass

LAYERS, HEADS, KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK = 30, 9, 3, 64, 32


@dataclass(frozen=True)
class TrtllmMassBenchConfig:
    batch: int = 64
    context: int = 1024
    rounds: int = 5
    device: str = "cpu"

    def __post_init__(self) -> None:
        require_positive(self, "batch", "context", "rounds")


class _OperatorCount(TorchDispatchMode):
    """Counts the aten operators run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def run_trtllm_mass_bench(cfg: TrtllmMassBenchConfig, progress=None) -> dict[str, Any]:
    """Operator counts, the largest difference between the two results, and each round's
    milliseconds (per request first on even rounds). ``progress`` advances once per round."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_row = -(-(cfg.context + TOKENS_PER_BLOCK) // TOKENS_PER_BLOCK)
    # [num_blocks, num_layers, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]
    pool = torch.randn(cfg.batch * blocks_per_row, LAYERS, 2, KV_HEADS, TOKENS_PER_BLOCK, HEAD_DIM,
                       generator=gen).bfloat16().to(cfg.device)
    block_lists = [list(range(i * blocks_per_row, (i + 1) * blocks_per_row)) for i in range(cfg.batch)]
    kv_lens = [cfg.context + i % TOKENS_PER_BLOCK for i in range(cfg.batch)]
    q = torch.randn(cfg.batch, LAYERS, HEADS, HEAD_DIM, generator=gen).bfloat16().to(cfg.device)
    sync = torch.cuda.synchronize if pool.device.type == "cuda" else (lambda: None)

    def per_request() -> np.ndarray:
        rows = [batch_decode_attention_mass(q[i : i + 1], pool, [block_lists[i]], [kv_lens[i]])[0].cpu()
                for i in range(cfg.batch)]
        out = np.zeros((cfg.batch, max(kv_lens)), dtype=np.float32)
        for i, mass in enumerate(rows):
            out[i, : len(mass)] = mass.numpy()
        return out

    def batched() -> np.ndarray:
        return batch_decode_attention_mass(q, pool, block_lists, kv_lens).cpu().numpy()

    ways = {"per_request": per_request, "batched": batched}
    results, operators = {}, {}
    for name, fn in ways.items():
        with _OperatorCount() as counter:
            results[name] = fn()
        operators[name] = counter.count
    rounds = []
    for round_ in range(cfg.rounds):
        order = list(ways.items()) if round_ % 2 == 0 else list(reversed(ways.items()))
        timed = {"round": round_}
        for name, fn in order:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            timed[f"{name}_ms"] = (time.perf_counter() - start) * 1e3
        rounds.append(timed)
        if progress is not None:
            progress.update(1)
    return {"config": asdict(cfg), "device": str(pool.device), "torch_threads": torch.get_num_threads(),
            "operators": operators, "copies_to_host": {"per_request": cfg.batch, "batched": 1},
            "max_abs_difference": float(np.abs(results["per_request"] - results["batched"]).max()),
            "rounds": rounds}
