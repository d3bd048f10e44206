# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench trtllm-mass``: what H2O's attention mass costs on the TensorRT-LLM path, against
the attention it observes, on the same tensors, in one run.

    decode   a batch of decode rows over a bf16 pool in TensorRT-LLM's layout:
               specification  scores.batch_decode_attention_mass (every layer's keys gathered
                              to float32 at once, up to 256 MiB)
               mass pass      mass.decode_mass (the manager's: on CPU the C++ pass with AMX
                              tiles or AVX-512 BF16 where the CPU has either, else the bounded
                              torch pass; the Triton kernels on CUDA); the header names it
               torch pass     mass_torch.decode_mass_torch, where the mass pass is another
                              (what CPUs without either run)
               attention      a decode attention over the same pool: K and V gathered through
                              the block table, then torch's fused attention (SDPA)
    prefill  one context row of T tokens, one layer:
               specification  scores.prefill_attention_mass (T <= 2,048: it is slow)
               mass pass      mass.prefill_mass (on CPU: the C++ pass where the CPU has AVX-512,
                              else the bounded torch pass; the row names it); and with H2O's
                              prefill_window of 64 queries
               torch pass     mass_torch.prefill_mass_torch, where the mass pass is another
                              (what CPUs without AVX-512 run)
               attention      torch's fused causal attention (SDPA) of the same q, k, v

Every way runs once untimed, then ``rounds`` times in alternating order; each ratio to the attention is given as the
median round's with its range over the rounds (mass of round i over attention of round i), and a
verdict that claims a side of the target only outside that range. Transient memory: the largest
bytes each mass way holds at once beside its inputs (``PeakMemory`` on CPU, the allocator's peak
on CUDA). Shapes: SmolLM2-135M's attention (30 layers, 9 query heads, 3 KV heads, head_dim 64),
tokens_per_block 32, lengths staggered by up to a block. ``VTOKEN_MAX_CPU_ISA`` limits the C++
passes (``mass_cpp.limit_isa``), not torch's attention: a CPU with AMX times its other kinds
against the attention it runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trtllm_vtoken.bench.memory import peak_transient_bytes
from trtllm_vtoken.bench.repeats import at_most_verdict
from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.integration.trtllm.mass import decode_mass, decode_pass, mass_backend, prefill_mass, prefill_pass
from trtllm_vtoken.integration.trtllm.mass_cpp import isa_ceiling
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES
from trtllm_vtoken.integration.trtllm.mass_torch import decode_mass_torch, prefill_mass_torch
from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass, prefill_attention_mass

LAYERS, HEADS, KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK = 30, 9, 3, 64, 32
SPEC_LONGEST_PROMPT = 2048
WINDOW = 64
CONTIGUOUS = "attention, K/V contiguous"


@dataclass(frozen=True)
class TrtllmMassBenchConfig:
    batch: int = 64
    context: int = 4096
    prompts: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    prompt_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    rounds: int = 3
    device: str = "cpu"

    def __post_init__(self) -> None:
        require_positive(self, "batch", "context", "rounds")
        if not self.prompts or min(self.prompts) < 1:
            raise ValueError(f"prompts must be positive token counts, got {self.prompts}")
        for name in self.prompt_dtypes:
            if name not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"prompt dtype must be float32, bfloat16 or float16, got {name!r}")


def time_ways(ways: dict[str, Callable[[], Any]], rounds: int, sync: Callable[[], None], progress=None) -> dict:
    """Milliseconds of each way per round, the ways in alternating order round by round, after
    one untimed call of each (first calls at a shape pay one-time costs: kernel selection,
    allocator growth, page faults)."""
    for fn in ways.values():
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(rounds):
        for name, fn in (list(ways.items()) if round_ % 2 == 0 else list(reversed(ways.items()))):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
        if progress is not None:
            progress.update(1)
    return times


def ratio_summary(numerator: list[float], denominator: list[float], target: float = 1.0) -> dict[str, Any]:
    """Round-by-round ratios: the median, the range, and whether it is at most ``target`` outside
    that range ("<= target", "> target", or "within the spread")."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    low, high = min(ratios), max(ratios)
    return {"ratio": statistics.median(ratios), "ratio_min": low, "ratio_max": high,
            "verdict": at_most_verdict(low, high, target, "x")}


def decode_section(cfg: TrtllmMassBenchConfig, sync, progress) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    blocks_per_row = -(-(cfg.context + TOKENS_PER_BLOCK) // TOKENS_PER_BLOCK)
    # [num_blocks, num_layers, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]
    pool = torch.randn(cfg.batch * blocks_per_row, LAYERS, 2, KV_HEADS, TOKENS_PER_BLOCK, HEAD_DIM,
                       generator=gen).bfloat16().to(cfg.device)
    block_lists = [list(range(i * blocks_per_row, (i + 1) * blocks_per_row)) for i in range(cfg.batch)]
    kv_lens = [cfg.context + i % TOKENS_PER_BLOCK for i in range(cfg.batch)]
    q = torch.randn(cfg.batch, LAYERS, HEADS, HEAD_DIM, generator=gen).bfloat16().to(cfg.device)
    table = torch.tensor(block_lists, device=pool.device)
    live = (torch.arange(blocks_per_row * TOKENS_PER_BLOCK, device=pool.device)[None, :]
            < torch.tensor(kv_lens, device=pool.device)[:, None])[:, None, None, :]  # [B, 1, 1, T]

    def gathered(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = pool[table, layer]  # [B, nb, 2, Hkv, tpb, D]: K and V through the block table
        return tuple(kv[:, :, i].transpose(1, 2).reshape(cfg.batch, KV_HEADS, -1, HEAD_DIM) for i in (0, 1))

    def attention(keys_values, mask) -> None:
        for layer in range(LAYERS):
            k, v = keys_values(layer)
            torch.nn.functional.scaled_dot_product_attention(q[:, layer, :, None], k, v, attn_mask=mask,
                                                             enable_gqa=True)

    # Each layer's keys and values laid out per row beforehand: the bytes a fused paged attention
    # (TensorRT-LLM's) reads, without the gather a torch attention over the pool pays. Cut to the
    # shortest row (at most 31 keys fewer than a row attends) so that no mask is needed and the
    # fused kernels serve (flash attention on CUDA): a baseline a little faster than the real one.
    shortest = min(kv_lens)
    contiguous = [tuple(t[:, :, :shortest].contiguous() for t in gathered(layer)) for layer in range(LAYERS)]
    ways = {"specification": lambda: batch_decode_attention_mass(q, pool, block_lists, kv_lens),
            "mass pass": lambda: decode_mass(q, pool, block_lists, kv_lens),
            "attention": lambda: attention(gathered, live),
            CONTIGUOUS: lambda: attention(contiguous.__getitem__, None)}
    chosen = decode_pass(q, pool, kv_lens)
    if chosen != "torch":
        ways["torch pass"] = lambda: decode_mass_torch(q, pool, block_lists, kv_lens)
    difference = (ways["mass pass"]() - ways["specification"]()).abs().max().item()
    times = time_ways(ways, cfg.rounds, sync, progress)
    return {"pass": chosen, "ms": times, "max_abs_difference": difference,
            "mass_pass_to_attention": ratio_summary(times["mass pass"], times["attention"]),
            "mass_pass_to_contiguous_attention": ratio_summary(times["mass pass"], times[CONTIGUOUS]),
            "torch_pass_to_contiguous_attention": (ratio_summary(times["torch pass"], times[CONTIGUOUS])
                                                   if "torch pass" in times else None),
            "peak_transient_bytes": {name: peak_transient_bytes(ways[name], pool.device)
                                     for name in ways if "attention" not in name}}


def prefill_section(cfg: TrtllmMassBenchConfig, tokens: int, dtype: torch.dtype, sync, progress) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(tokens, heads, HEAD_DIM, generator=gen).to(dtype).to(cfg.device)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    ways = {"mass pass": lambda: prefill_mass(q, k),
            f"mass pass, window {WINDOW}": lambda: prefill_mass(q, k, window=WINDOW),
            "attention": lambda: torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                enable_gqa=True)}
    chosen = prefill_pass(q, k)
    if chosen not in ("torch", "triton"):
        ways["torch pass"] = lambda: prefill_mass_torch(q, k)
    difference = None
    if tokens <= SPEC_LONGEST_PROMPT:
        ways["specification"] = lambda: prefill_attention_mass(q, k)
        difference = (ways["mass pass"]() - ways["specification"]()).abs().max().item()
    times = time_ways(ways, cfg.rounds, sync, progress)
    return {"tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "pass": chosen, "ms": times,
            "max_abs_difference": difference,
            "mass_pass_to_attention": ratio_summary(times["mass pass"], times["attention"]),
            "windowed_to_attention": ratio_summary(times[f"mass pass, window {WINDOW}"], times["attention"]),
            "torch_pass_to_attention": (ratio_summary(times["torch pass"], times["attention"])
                                        if "torch pass" in times else None),
            "peak_transient_bytes": {name: peak_transient_bytes(ways[name], q.device)
                                     for name in ways if name != "attention"}}


def run_trtllm_mass_bench(cfg: TrtllmMassBenchConfig, progress=None) -> dict[str, Any]:
    """The decode section, then a prefill section per prompt length and dtype. ``progress``
    advances once per round of each section."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("vtoken bench trtllm-mass --device cuda needs a CUDA device")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {"config": asdict(cfg), "device": str(device), "backend": mass_backend(device),
              "torch_threads": torch.get_num_threads(), "cap_bytes": DEFAULT_CAP_BYTES, "isa_ceiling": isa_ceiling(),
              "decode": decode_section(cfg, sync, progress)}
    result["prefill"] = [prefill_section(cfg, tokens, getattr(torch, name), sync, progress)
                         for name in cfg.prompt_dtypes for tokens in cfg.prompts]
    return result
