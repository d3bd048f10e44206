# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench quality``: does relocation change what the model says? (real model)

The same ShareGPT prompts are generated greedily three times from one engine configuration:
native (full KV, the reference), naive-evict and vtoken with the same policy and budget. vToken
must say what naive-evict says: the exact-match rate, the mean paired ROUGE-L difference
(ROUGE-L F1 of vtoken vs native minus that of naive-evict vs native, per prompt) and the
output-length ratio measure how far apart they are. The paper reports -0.0016 for ROUGE-L.

Those three run in the engine's default order, TensorRT-LLM's overlap scheduler, where a policy
that reads the forward's attention (H2O, Scissorhands) takes a step that may evict before the next
forward (``decode_decision="at_once"``). A fourth run, vtoken in the plain order
(``overlap_scheduler=False``: each iteration's decision before the next forward, as the published
policies decide), checks that the default's answers are the plain order's; a fifth, vtoken with
``decode_decision="lagged"`` (each decision beside the next forward, one iteration late), says
what the lag would change: how many answers are the plain order's, and its ROUGE-L against
native. Count-based policies decide as in the plain order in every overlap mode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# (label, variant, overlap scheduler, decode_decision): the default order, vtoken in the plain
# order, and vtoken deciding a step late.
RUNS = (("native", "native", True, "at_once"), ("naive-evict", "naive-evict", True, "at_once"),
        ("vtoken", "vtoken", True, "at_once"), ("vtoken, plain order", "vtoken", False, "at_once"),
        ("vtoken, lagged", "vtoken", True, "lagged"))


@dataclass(frozen=True)
class QualityBenchConfig:
    prompts: int = 144
    max_tokens: int = 64
    max_prompt_tokens: int = 384
    policy: str = "h2o"
    budget: str = "0.5"
    num_blocks: int = 4096
    max_batch_size: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompts <= 0 or self.max_tokens <= 0:
            raise ValueError("prompts and max_tokens must be positive")


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace words (longest common subsequence)."""
    a, b = candidate.lower().split(), reference.lower().split()
    if not a or not b:
        return float(a == b)
    previous = [0] * (len(b) + 1)
    for word in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if word == other else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def run_quality_bench(cfg: QualityBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.workloads import make_workload

    items = make_workload("sharegpt", cfg.prompts, tokenizer, seed=cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]
    outputs: dict[str, list] = {}
    order_of: dict[str, dict[str, Any]] = {}  # each run's order, as its engine took it
    for label, variant, overlap, decision in RUNS:
        engine = Engine(model, EngineConfig(
            variant=variant, mode="dense", overlap_scheduler=overlap, decode_decision=decision, policy=cfg.policy,
            budget=cfg.budget, num_blocks=cfg.num_blocks, max_batch_size=cfg.max_batch_size,
            max_seq_len=cfg.max_prompt_tokens + cfg.max_tokens + 64, check_invariants=True), tokenizer)
        ids = [engine.add_request(p, SamplingParams(max_tokens=cfg.max_tokens)) for p in prompts]
        while engine.has_unfinished():
            finished = sum(o.finished for o in engine.step())
            if progress is not None:
                progress.update(finished)
        outputs[label] = [engine.pop_finished(i) for i in ids]
        order_of[label] = {"overlap_scheduler": engine.config.overlap_scheduler,
                           "decode_decision": engine.config.decode_decision}
    native, naive, vtoken, plain, lagged = (outputs[label] for label, *_ in RUNS)
    exact = [a.output_ids == b.output_ids for a, b in zip(naive, vtoken)]
    rouge_naive = np.array([rouge_l(n.text, r.text) for n, r in zip(naive, native)])
    rouge_vtoken = np.array([rouge_l(v.text, r.text) for v, r in zip(vtoken, native)])
    rouge_plain = np.array([rouge_l(p.text, r.text) for p, r in zip(plain, native)])
    rouge_lagged = np.array([rouge_l(g.text, r.text) for g, r in zip(lagged, native)])
    length_ratio = sum(len(v.output_ids) for v in vtoken) / sum(len(n.output_ids) for n in naive)
    return {
        "config": asdict(cfg), "pairs": len(exact),
        "exact_match_rate": float(np.mean(exact)),
        "rouge_l_vs_native": {"naive-evict": float(rouge_naive.mean()), "vtoken": float(rouge_vtoken.mean())},
        "mean_paired_rouge_l_difference": float((rouge_vtoken - rouge_naive).mean()),
        "output_length_ratio": length_ratio,
        "plain_order": {
            "same_answer_rate": float(np.mean([v.output_ids == p.output_ids for v, p in zip(vtoken, plain)])),
            "rouge_l_vs_native": float(rouge_plain.mean()),
            "mean_paired_rouge_l_overlap_minus_plain": float((rouge_vtoken - rouge_plain).mean()),
        },
        "lagged": {
            "same_answer_as_plain_rate": float(np.mean([g.output_ids == p.output_ids for g, p in zip(lagged, plain)])),
            "rouge_l_vs_native": float(rouge_lagged.mean()),
            "mean_paired_rouge_l_lagged_minus_plain": float((rouge_lagged - rouge_plain).mean()),
        },
        "order": order_of,
        "examples": [{"prompt": items[i].prompt[:200], "native": native[i].text, "naive-evict": naive[i].text,
                      "vtoken": vtoken[i].text} for i in range(min(3, len(items)))],
    }


def plot_quality(result: dict[str, Any], path) -> None:
    """ROUGE-L against native for both evicting variants, vtoken in the plain order and vtoken
    lagged, with the exact-match rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rouge = dict(result["rouge_l_vs_native"], **{"vtoken, plain order": result["plain_order"]["rouge_l_vs_native"],
                                                 "vtoken, lagged": result["lagged"]["rouge_l_vs_native"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(rouge), list(rouge.values()), color=["tab:orange", "tab:green", "tab:blue", "tab:gray"])
    ax.set(ylim=(0, 1), ylabel="ROUGE-L F1 vs native (full KV)",
           title=f"{result['pairs']} prompts: vtoken = naive-evict in {100 * result['exact_match_rate']:.1f}%, "
                 f"paired diff {result['mean_paired_rouge_l_difference']:+.4f}")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
