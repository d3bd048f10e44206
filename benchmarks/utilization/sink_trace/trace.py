"""Why naive-evict's StreamingLLM and sliding-window rows of ``vtoken bench utilization`` are equal
on ShareGPT (and differ slightly on longdoc): the workloads and engine settings of the bench, naive
-evict, both policies, prefix caching on (the bench) and off. Per run: utilization, mean blocks,
evictions; per workload: how many of each prompt's first ``n_sink`` tokens lie in full blocks of
the chat template every prompt shares (prefix caching keeps them: no policy evicts them), and
whether the two policies evicted the same tokens (a digest of every request's victims per step),
and where a request first evicted a sink position: its step and how many requests ran then.

    python benchmarks/utilization/sink_trace/trace.py > benchmarks/utilization/sink_trace/output.txt
"""

import hashlib
import json

from trtllm_vtoken.bench.utilization import POLICY_OPTIONS, UtilizationBenchConfig
from trtllm_vtoken.bench.variants import serve_workload
from trtllm_vtoken.cli.bench_common import load_model
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.workloads import make_workload

cfg = UtilizationBenchConfig()
_, model, tokenizer = load_model(None)
n_sink, tpb = POLICY_OPTIONS["streaming_llm"]["n_sink"], cfg.tokens_per_block
for workload in cfg.workloads:
    items = make_workload(workload, cfg.requests, tokenizer, seed=cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens,
                          max_output_tokens=cfg.max_output_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]
    common = 0  # tokens every prompt begins with
    while all(len(p) > common and p[common] == prompts[0][common] for p in prompts):
        common += 1
    print(json.dumps({"workload": workload, "prompt_lengths": [len(p) for p in prompts], "common_prefix_tokens": common,
                      "full_blocks_of_common_prefix": common // tpb, "sinks_inside_them": min(n_sink, common // tpb * tpb)}))
    max_seq = max(len(p) for p in prompts) + cfg.max_output_tokens
    roomy = cfg.requests * -(-max_seq // tpb)
    for prefix_caching in (True, False):
        evicted = {}
        for policy in ("streaming_llm", "sliding_window"):
            engine = Engine(model, EngineConfig(
                variant="naive-evict", mode="dense", policy=policy, budget=cfg.budget,
                policy_options=POLICY_OPTIONS.get(policy, {}), tokens_per_block=tpb, num_blocks=roomy,
                max_batch_size=cfg.requests, max_seq_len=max_seq, check_invariants=True,
                prefix_caching=prefix_caching), tokenizer)
            engine.record_trace = True  # each request's victims per step (Request.evictions)
            popped, pop = [], engine.pop_finished
            engine.pop_finished = lambda req_id: popped.append(pop(req_id)) or popped[-1]
            result, outputs = serve_workload(engine, prompts, items, None)
            traces = [[list(v) for v in request.evictions] for request in popped]
            evicted[policy] = hashlib.sha256(json.dumps(traces).encode()).hexdigest()[:16]
            # Each request's first eviction of a sink position (id < n_sink): its step (every request
            # is admitted and prefilled in the first step), and how many requests ran then.
            sinks = []
            for i, steps in enumerate(traces):
                first = next((k for k, victims in enumerate(steps) if any(t < n_sink for t in victims)), None)
                if first is not None:
                    sinks.append({"request": i, "step": first, "running": sum(len(t) > first for t in traces)})
            print(json.dumps({"workload": workload, "prefix_caching": prefix_caching, "policy": policy,
                              "kv_utilization_pct": round(100 * result["kv_utilization"], 2),
                              "mean_blocks": round(result["mean_blocks"], 2), "tokens_evicted": result["tokens_evicted"],
                              "blocks_reclaimed": result["blocks_reclaimed"], "evictions_digest": evicted[policy],
                              "sink_evictions": sinks}))
