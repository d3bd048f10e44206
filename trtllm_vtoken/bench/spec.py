# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench spec``: speculative decoding with n-gram drafts on the real model, with and
without vToken.

Requests that copy from their prompt (the first lines of a standard-library source, to be
repeated) give prompt lookup something to find. Native and vtoken dense (H2O), each with and
without drafting, serve the same requests at once, ``repeats`` runs in alternating order: tokens/s
(median and range), steps, the drafts' acceptance rate, and whether drafting changed any greedy
output (it should not: the model's own token is kept wherever a draft differs) and whether vtoken's
decisions with drafting equal naive-evict's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from trtllm_vtoken.bench.repeats import run_alternating
from trtllm_vtoken.config_base import require_positive

TASK = "Repeat the following Python source exactly, line by line, and nothing else:\n\n"


@dataclass(frozen=True)
class SpecBenchConfig:
    requests: int = 4
    source_tokens: int = 192
    max_output_tokens: int = 96
    max_draft_len: int = 4
    max_matching_ngram_size: int = 3
    budget: str = "0.5"
    tokens_per_block: int = 16
    repeats: int = 3

    def __post_init__(self) -> None:
        require_positive(self, "requests", "source_tokens", "max_output_tokens", "max_draft_len",
                         "max_matching_ngram_size", "repeats")


def prompts(cfg: SpecBenchConfig, tokenizer) -> list[list[int]]:
    from trtllm_vtoken.workloads.longdoc import stdlib_files

    out = []
    for path in stdlib_files():
        try:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= cfg.source_tokens:
            out.append(tokenizer.encode(TASK + tokenizer.decode(ids[: cfg.source_tokens]), chat=True))
        if len(out) == cfg.requests:
            return out
    raise ValueError(f"fewer than {cfg.requests} standard-library files of {cfg.source_tokens} tokens")


def run_spec_bench(cfg: SpecBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    batch = prompts(cfg, tokenizer)
    longest = max(map(len, batch)) + cfg.max_output_tokens
    blocks = cfg.requests * -(-longest // cfg.tokens_per_block) + 4
    spec = {"max_draft_len": cfg.max_draft_len, "max_matching_ngram_size": cfg.max_matching_ngram_size}
    outputs: dict[str, list] = {}

    def serve(label: str, settings: dict[str, Any]) -> dict[str, Any]:
        engine = Engine(model, EngineConfig(tokens_per_block=cfg.tokens_per_block, num_blocks=blocks,
                                            max_batch_size=cfg.requests, max_seq_len=longest,
                                            overlap_scheduler=False, policy="h2o", budget=cfg.budget, **settings),
                        tokenizer, record_trace=True)
        ids = [engine.add_request(p, SamplingParams(max_tokens=cfg.max_output_tokens, ignore_eos=True))
               for p in batch]
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - start
        requests = [engine.pop_finished(i) for i in ids]
        outputs[label] = [(r.output_ids, r.evictions) for r in requests]
        drafted = engine.speculation.stats if engine.speculation is not None else None
        tokens = sum(len(r.output_ids) for r in requests)
        return {"tokens_per_s": tokens / wall, "steps": engine.stats.steps, "output_tokens": tokens,
                "drafted": drafted.drafted if drafted else 0, "accepted": drafted.accepted if drafted else 0}

    rows = [("native", {"variant": "native"}), ("native + drafts", {"variant": "native", "speculative_config": spec}),
            ("vtoken", {"variant": "vtoken"}), ("vtoken + drafts", {"variant": "vtoken", "speculative_config": spec}),
            ("naive-evict + drafts", {"variant": "naive-evict", "speculative_config": spec})]
    summary = run_alternating(rows, cfg.repeats, serve, progress, spread=("steps",))
    for row in summary:
        row["acceptance"] = row["accepted"] / row["drafted"] if row["drafted"] else None
    same = {
        "native": sum(a[0] == b[0] for a, b in zip(outputs["native"], outputs["native + drafts"])),
        "vtoken": sum(a[0] == b[0] for a, b in zip(outputs["vtoken"], outputs["vtoken + drafts"])),
        "vtoken_vs_naive_evict": sum(a == b for a, b in zip(outputs["vtoken + drafts"], outputs["naive-evict + drafts"])),
    }
    return {"config": asdict(cfg), "prompt_tokens": [len(p) for p in batch], "rows": summary,
            "same_outputs_with_drafts": same, "requests": cfg.requests}
