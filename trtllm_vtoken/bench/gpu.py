# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench gpu``: what only a CUDA device can measure, in one run.

    copy     relocating plans of 256-16384 tokens in a Llama-3.1-8B-shaped bf16 pool: the CUDA
             kernel vs torch indexing vs a plain device-to-device copy of the same bytes
    decode   one decode step of the model, eager vs CUDA-graph replay, at several batch sizes
    engine   the engine end to end on CUDA: native (eager and graphs), indirection-only (vtoken
             hooks on, budget 1.0, nothing evicted), naive-evict, vtoken dense (kernel, torch
             copy, host-synchronized copies, shift positions) and lazy, under the overlap
             scheduler; native and vtoken dense also in the plain order; greedy outputs of vtoken
             vs naive-evict

The model has SmolLM2-135M's shapes with random weights (the real weights do not travel to a
device machine); timings depend on shapes, not on weights.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch

from trtllm_vtoken.runtime.config import EngineConfig

ENGINE_RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("native, eager", dict(variant="native", cuda_graphs=False)),
    ("native, graphs", dict(variant="native")),
    ("indirection-only", dict(variant="vtoken", budget="1.0")),
    ("naive-evict", dict(variant="naive-evict")),
    ("vtoken dense", dict(variant="vtoken")),
    ("vtoken dense, torch copy", dict(variant="vtoken", relocation_kernel="torch")),
    ("vtoken dense, sync copies", dict(variant="vtoken", synchronous_copies=True)),
    ("vtoken lazy", dict(variant="vtoken", mode="lazy")),
    ("vtoken dense, shift positions", dict(variant="vtoken", positions="shift")),
    ("native, graphs, plain order", dict(variant="native", overlap_scheduler=False)),
    ("vtoken dense, plain order", dict(variant="vtoken", overlap_scheduler=False)),
)
"""Every row but the "plain order" ones runs the overlap scheduler (the engine's default): the
step of iteration N beside forward N+1 (``docs/overlap.md``)."""


@dataclass(frozen=True)
class GpuBenchConfig:
    requests: int = 64
    prompt_tokens: int = 256
    output_tokens: int = 128
    tokens_per_block: int = 32
    policy: str = "h2o"
    budget: str = "0.5"
    dtype: str = "bfloat16"
    copy_moves: tuple[int, ...] = (256, 1024, 4096, 16384)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    repeats: int = 3
    """Engine runs per row, in alternating order (forward, backward, ...): tokens/s is the
    median and the spread shows the run-to-run noise."""
    seed: int = 0

    def engine_config(self, **overrides: Any) -> EngineConfig:
        per_request = -(-(self.prompt_tokens + self.output_tokens) // self.tokens_per_block)
        values: dict[str, Any] = dict(
            policy=self.policy, budget=self.budget, tokens_per_block=self.tokens_per_block,
            num_blocks=self.requests * per_request + 8, max_batch_size=self.requests,
            max_seq_len=self.prompt_tokens + self.output_tokens, dtype=self.dtype, device="cuda",
            seed=self.seed,
        )
        values.update(overrides)
        return EngineConfig(**values)


def smollm2_shaped_model(dtype: str):
    from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():  # keep activations in range: random weights, small scale
        torch.nn.init.normal_(p, std=0.02)
    return model.to("cuda", getattr(torch, dtype)).eval()


def _median_ms(fn, reps: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def copy_bench(cfg: GpuBenchConfig) -> list[dict[str, Any]]:
    """Kernel vs torch indexing vs device-to-device copy, bytes read + written over time."""
    from trtllm_vtoken.reclaim import cuda_kernel
    from trtllm_vtoken.reclaim.copy import relocate_slots

    pool = torch.randn(1024, 32, 2, 8, 32, 128, device="cuda", dtype=torch.bfloat16)
    per_move = pool[0, :, :, :, 0].numel() * pool.element_size()
    scratch = torch.empty(2 * max(cfg.copy_moves) * per_move, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for moves in cfg.copy_moves:
        perm = torch.randperm(pool.shape[0] * 32, generator=gen)
        dst, src = perm[:moves].cuda(), perm[moves : 2 * moves].cuda()
        nbytes = moves * per_move
        row = {"moves": moves, "mib": nbytes / 2**20}
        d2d = _median_ms(lambda: scratch[nbytes : 2 * nbytes].copy_(scratch[:nbytes]), 20)
        row["d2d_ms"], row["d2d_gbs"] = d2d, 2 * nbytes / d2d / 1e6
        torch_ms = _median_ms(lambda: relocate_slots(pool, src, dst), 20)
        row["torch_ms"], row["torch_gbs"] = torch_ms, 2 * nbytes / torch_ms / 1e6
        if cuda_kernel.load() is not None:
            kernel_ms = _median_ms(lambda: cuda_kernel.relocate_slots_cuda(pool, src, dst), 20)
            row["kernel_ms"], row["kernel_gbs"] = kernel_ms, 2 * nbytes / kernel_ms / 1e6
            row["kernel_vs_d2d"] = row["kernel_gbs"] / row["d2d_gbs"]
        rows.append(row)
    return rows


def decode_bench(cfg: GpuBenchConfig, model) -> list[dict[str, Any]]:
    """One decode step at ``prompt_tokens`` of context per row: eager forward vs graph replay."""
    from trtllm_vtoken.runtime.cuda_graph import DecodeGraphs
    from trtllm_vtoken.runtime.kv_cache import PagedKVCache

    mc, tpb = model.config, cfg.tokens_per_block
    blocks_per_row = -(-(cfg.prompt_tokens + cfg.output_tokens) // tpb)
    batch_max = max(cfg.decode_batches)
    cache = PagedKVCache(batch_max * blocks_per_row, tpb, mc.num_hidden_layers, mc.num_key_value_heads,
                         mc.head_dim, batch_max, blocks_per_row, dtype=model.lm_head.weight.dtype,
                         device="cuda")
    cache.pool.normal_()
    graphs = DecodeGraphs(model, cache, batch_max, masked=False, return_mass=True)
    rows = []
    for batch in cfg.decode_batches:
        tables = [list(range(i * blocks_per_row, (i + 1) * blocks_per_row)) for i in range(batch)]
        lens = [cfg.prompt_tokens + 1] * batch
        ids = torch.randint(0, mc.vocab_size, (batch, 1), device="cuda")
        pos = torch.full((batch, 1), cfg.prompt_tokens, device="cuda")
        slots = torch.tensor([[t[cfg.prompt_tokens // tpb] * tpb + cfg.prompt_tokens % tpb] for t in tables],
                             device="cuda")
        ones = torch.ones(batch, dtype=torch.long, device="cuda")

        def eager():
            cache.set_batch(tables, lens)
            model(ids, pos, slots, ones, cache, None, return_mass=True, logits_at=ones - 1)

        def replay():
            cache.set_batch(tables, lens)
            graphs.run(ids, pos, slots, None)

        eager_ms, graph_ms = _median_ms(eager, 20), _median_ms(replay, 20)
        rows.append({"batch": batch, "eager_ms": eager_ms, "graph_ms": graph_ms, "speedup": eager_ms / graph_ms})
    return rows


def engine_bench(cfg: GpuBenchConfig, model, progress=None) -> list[dict[str, Any]]:
    from trtllm_vtoken.bench.repeats import run_alternating
    from trtllm_vtoken.bench.variants import serve_workload
    from trtllm_vtoken.runtime.engine import Engine

    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = [torch.randint(0, model.config.vocab_size, (cfg.prompt_tokens,), generator=gen).tolist()
               for _ in range(cfg.requests)]
    items = [SimpleNamespace(max_tokens=cfg.output_tokens)] * cfg.requests
    outputs = {}

    def run(label: str, overrides: dict[str, Any]) -> dict[str, Any]:
        engine = Engine(model, cfg.engine_config(**overrides))
        serve_workload(engine, prompts[:2], items[:2], None)  # warm-up: allocator, first captures
        result, outputs[label] = serve_workload(engine, prompts, items, None)
        result.pop("blocks_per_step")
        result["graph_replays"] = engine.graphs.replays if engine.graphs else 0
        return result

    runs = run_alternating(ENGINE_RUNS, cfg.repeats, run, progress)
    reference = outputs["naive-evict"]
    for row in runs:  # naive-evict runs the overlap order: compared with the rows in that order
        if row["variant"] == "vtoken" and row["label"] != "indirection-only" and "plain order" not in row["label"]:
            same = [a == b for a, b in zip(reference, outputs[row["label"]])]
            row["exact_match_vs_naive_evict"] = sum(same) / len(same)
    plain, overlapped = outputs["native, graphs, plain order"], outputs["native, graphs"]
    for row in runs:  # the overlap scheduler leaves native's tokens as they are
        if row["label"] == "native, graphs":
            row["exact_match_vs_plain_order"] = sum(a == b for a, b in zip(plain, overlapped)) / len(plain)
    native = next(r for r in runs if r["label"] == "native, graphs")["tokens_per_s"]
    for row in runs:
        row["throughput_vs_native_graphs"] = row["tokens_per_s"] / native
    return runs


def run_gpu_bench(cfg: GpuBenchConfig, progress=None) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise ValueError("vtoken bench gpu needs a CUDA device")
    from trtllm_vtoken.reclaim import cuda_kernel

    started = time.perf_counter()
    result: dict[str, Any] = {
        "config": asdict(cfg), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "relocation_kernel": cuda_kernel.describe(),
    }
    result["copy"] = copy_bench(cfg)
    torch.cuda.empty_cache()  # the copy benchmark's 4 GiB pool is gone
    model = smollm2_shaped_model(cfg.dtype)
    result["decode"] = decode_bench(cfg, model)
    result["engine"] = engine_bench(cfg, model, progress)
    result["wall_s"] = time.perf_counter() - started
    return result
