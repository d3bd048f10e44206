# SPDX-License-Identifier: Apache-2.0
"""Does a greedy answer depend on what else runs? Real model, prefix caching on.

    batch rows       for each ``prefix_reuse`` rule (copy, the default; share) and variant
                     (naive-evict, vtoken dense): the same chat prompts served one at a time
                     (each alone in the engine, after a request that evicts nothing left the chat
                     template cached) and all at once; how many answers and eviction traces agree,
                     the prompt tokens reused, and the most blocks held at once
    preemption rows  for native, naive-evict and vtoken: the prompts all at once in a roomy pool
                     and in a pool small enough that greedy admission preempts (a preempted request
                     is prefilled again, prompt and output so far, and its policy chooses again);
                     how many answers agree with the roomy pool's, and how many preemptions
    bitwise rows     copy reuse, native and vtoken, ``batch_invariant`` off and on: how many
                     requests have every log-probability bitwise the same alone and together, and
                     the largest difference of a cumulative log-probability
    cost rows        the forward's time per decode step with ``batch_invariant`` off and on, for
                     1, 4 and 8 requests of one prompt, in alternating rounds (median and range)

The other rows are counts, the same on every run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trtllm_vtoken.config_base import require_positive

CHAT = ("Write one sentence about cats.", "Write one sentence about the sea.", "Write one sentence about rain.",
        "Write one sentence about bread.", "Write one sentence about trains.", "Write one sentence about music.")


@dataclass(frozen=True)
class InvarianceBenchConfig:
    sharegpt_requests: int = 6
    """ShareGPT conversations served beside the six chat prompts (their first turns, chat template)."""
    max_prompt_tokens: int = 192
    new_tokens: int = 24
    policy: str = "h2o"
    budget: float = 0.5
    tokens_per_block: int = 16
    tight_fraction: float = 0.4
    """The preemption rows' small pool: this share of the blocks native needs to hold every request
    at its full length at once (greedy admission preempts when it runs dry)."""
    seed: int = 0
    cost_batches: tuple[int, ...] = (1, 4, 8)
    """Requests decoding together in the cost rows."""
    rounds: int = 3
    """Alternating rounds of the cost rows (off, on, off, on, ...)."""

    def __post_init__(self) -> None:
        require_positive(self, "max_prompt_tokens", "new_tokens", "tokens_per_block", "rounds")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (the cost rows time the decode steps after the first token), "
                             f"got {self.new_tokens}")
        if not self.cost_batches or min(self.cost_batches) < 1:
            raise ValueError(f"cost_batches must be positive batch sizes, got {self.cost_batches}")
        if self.sharegpt_requests < 0:
            raise ValueError(f"sharegpt_requests must be >= 0, got {self.sharegpt_requests}")
        if not 0.0 < self.budget <= 1.0 or not 0.0 < self.tight_fraction < 1.0:
            raise ValueError(f"budget must lie in (0, 1] and tight_fraction in (0, 1), got {self.budget}, "
                             f"{self.tight_fraction}")

    def full_blocks(self, prompts: list[list[int]]) -> int:
        tpb = self.tokens_per_block
        return sum(-(-(len(p) + self.new_tokens) // tpb) for p in prompts)


def serve(model: Any, prompts: list[list[int]], cfg: InvarianceBenchConfig, together: bool, **config) -> dict[str, Any]:
    """Serves ``prompts`` (request ids 0..n-1) alone one after another or all at once."""
    from trtllm_vtoken.policies.request_settings import EvictionSettings
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    tpb = cfg.tokens_per_block
    values = dict(policy=cfg.policy, budget=cfg.budget, tokens_per_block=tpb, num_blocks=cfg.full_blocks(prompts) + 8,
                  max_batch_size=len(prompts), max_seq_len=cfg.max_prompt_tokens + cfg.new_tokens + tpb)
    values.update(config)
    engine = Engine(model, EngineConfig(**values), record_trace=True)
    params = SamplingParams(max_tokens=cfg.new_tokens, ignore_eos=True, logprobs=1)

    def drain(ids: list[int]) -> list:
        while engine.has_unfinished():
            engine.step()
        return [engine.pop_finished(i) for i in ids]

    if together:
        done = drain([engine.add_request(p, params, req_id=i) for i, p in enumerate(prompts)])
    else:
        if values.get("variant") != "native":  # the chat template cached by a request that evicts nothing
            keep = SamplingParams(max_tokens=1, eviction=EvictionSettings(policy="native"))
            drain([engine.add_request(prompts[0], keep, req_id=len(prompts))])
        done = [drain([engine.add_request(p, params, req_id=i)])[0] for i, p in enumerate(prompts)]
    return {"outputs": [r.output_ids for r in done], "evictions": [r.evictions for r in done],
            "logprobs": [r.logprobs for r in done], "cumulative_logprobs": [r.cumulative_logprob for r in done],
            "cached_prompt_tokens": engine.stats.cached_prompt_tokens, "preemptions": engine.stats.preemptions,
            "peak_blocks": engine.kv.stats.peak_blocks_used}


def agree(a: dict[str, Any], b: dict[str, Any], key: str) -> int:
    return sum(x == y for x, y in zip(a[key], b[key]))


def run_invariance_bench(cfg: InvarianceBenchConfig, model: Any, tokenizer: Any, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.workloads import make_workload

    prompts = [tokenizer.encode(q, chat=True) for q in CHAT]
    if cfg.sharegpt_requests:
        items = make_workload("sharegpt", cfg.sharegpt_requests, tokenizer, seed=cfg.seed,
                              max_prompt_tokens=cfg.max_prompt_tokens)
        prompts += [tokenizer.encode(item.prompt, chat=True)[: cfg.max_prompt_tokens] for item in items]

    def tick():
        if progress is not None:
            progress.update(1)

    batch_rows = []
    for reuse in ("copy", "share"):
        for variant in ("naive-evict", "vtoken"):
            runs = {}
            for together in (False, True):
                runs[together] = serve(model, prompts, cfg, together, variant=variant, prefix_reuse=reuse)
                tick()
            batch_rows.append({
                "prefix_reuse": reuse, "variant": variant, "requests": len(prompts),
                "same_output": agree(runs[False], runs[True], "outputs"),
                "same_decisions": agree(runs[False], runs[True], "evictions"),
                "cached_prompt_tokens_alone": runs[False]["cached_prompt_tokens"],
                "cached_prompt_tokens_together": runs[True]["cached_prompt_tokens"],
                "peak_blocks_together": runs[True]["peak_blocks"],
                "outputs_together": runs[True]["outputs"]})
    tight = max(int(cfg.tight_fraction * cfg.full_blocks(prompts)),
                max(-(-(len(p) + cfg.new_tokens) // cfg.tokens_per_block) for p in prompts) + 1)
    preemption_rows = []
    for variant in ("native", "naive-evict", "vtoken"):
        roomy = serve(model, prompts, cfg, True, variant=variant)
        tick()
        small = serve(model, prompts, cfg, True, variant=variant, num_blocks=tight, admission="greedy")
        tick()
        preemption_rows.append({"variant": variant, "requests": len(prompts), "num_blocks": tight,
                                "preemptions": small["preemptions"], "same_output": agree(roomy, small, "outputs")})
    bitwise_rows = []
    for batch_invariant in (False, True):
        for variant in ("native", "vtoken"):
            alone, together = (serve(model, prompts, cfg, t, variant=variant, batch_invariant=batch_invariant)
                               for t in (False, True))
            tick()
            bitwise_rows.append({
                "batch_invariant": batch_invariant, "variant": variant, "requests": len(prompts),
                "same_output": agree(alone, together, "outputs"), "same_logprobs": agree(alone, together, "logprobs"),
                "largest_cumulative_logprob_difference": max(
                    abs(a - b) for a, b in zip(alone["cumulative_logprobs"], together["cumulative_logprobs"]))})
    copy_vtoken = next(r for r in batch_rows if r["prefix_reuse"] == "copy" and r["variant"] == "vtoken")
    copy_naive = next(r for r in batch_rows if r["prefix_reuse"] == "copy" and r["variant"] == "naive-evict")
    vtoken_equals_naive = sum(a == b for a, b in zip(copy_vtoken["outputs_together"], copy_naive["outputs_together"]))
    for row in batch_rows:
        del row["outputs_together"]
    return {"config": asdict(cfg), "prompt_tokens": [len(p) for p in prompts], "batch_rows": batch_rows,
            "preemption_rows": preemption_rows, "copy_vtoken_equals_naive_evict": vtoken_equals_naive,
            "bitwise_rows": bitwise_rows, "cost_rows": cost_rows(model, max(prompts, key=len), cfg, tick),
            "invariant_forward": invariant_forward(model)}


def invariant_forward(model) -> dict[str, int]:
    """What the batch-invariant forwards above ran on here: every product on a multiple of
    ``row_multiple`` rows, on ``threads`` intra-op threads, the process running ``process_threads``
    (``runtime/batch_invariance.py`` ``invariant_products``, measured once per process)."""
    import torch

    from trtllm_vtoken.runtime.batch_invariance import invariant_products

    multiple, threads = invariant_products(model)
    return {"row_multiple": multiple, "threads": threads, "process_threads": torch.get_num_threads()}


def decode_step_seconds(model, prompt: list[int], batch: int, cfg: InvarianceBenchConfig, **config) -> float:
    """The forward's seconds per decode step for ``batch`` requests of ``prompt`` (vtoken, H2O,
    prefix caching off: each prompt computed), from the iteration after the last prefill to the end."""
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    tpb = cfg.tokens_per_block
    length = len(prompt) + cfg.new_tokens
    engine = Engine(model, EngineConfig(policy=cfg.policy, budget=cfg.budget, tokens_per_block=tpb,
                                        num_blocks=batch * -(-length // tpb) + 8, max_batch_size=batch,
                                        max_seq_len=length + tpb, prefix_caching=False, **config))
    params = SamplingParams(max_tokens=cfg.new_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    while engine.stats.prefill_tokens < batch * len(prompt) and engine.has_unfinished():
        engine.step()
    start_seconds, start_steps = engine.stats.forward_seconds, engine.stats.steps
    while engine.has_unfinished():
        engine.step()
    for i in ids:
        engine.pop_finished(i)
    return (engine.stats.forward_seconds - start_seconds) / (engine.stats.steps - start_steps)


def cost_rows(model, prompt: list[int], cfg: InvarianceBenchConfig, tick) -> list[dict[str, Any]]:
    """Per batch size: ms per decode step off and on over alternating rounds, and their ratio."""
    rows = []
    for batch in cfg.cost_batches:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(cfg.rounds):
            for batch_invariant in (False, True):
                times[batch_invariant].append(1e3 * decode_step_seconds(model, prompt, batch, cfg,
                                                                        batch_invariant=batch_invariant))
        tick()
        ratios = sorted(on / off for off, on in zip(times[False], times[True]))
        rows.append({"batch": batch, "prompt_tokens": len(prompt), "rounds": cfg.rounds,
                     "decode_ms_off": times[False], "decode_ms_on": times[True],
                     "ratio_median": ratios[len(ratios) // 2], "ratio_range": [ratios[0], ratios[-1]]})
    return rows
