"""Evictions made in the iteration in which their request finished: since 3ecf7a8 the engine begins
its step before sampling, so a request sampling its last token still takes that step (its new
token joins the table, and one over its budget evicts). naive-evict at ``vtoken bench variants
--quick``'s sizes, prefix caching off.

    python benchmarks/variants/last_iteration/last_iterations.py
"""
import dataclasses
from trtllm_vtoken.bench.variants import VariantsBenchConfig
from trtllm_vtoken.cli.bench_common import load_model
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.request import Status
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.workloads import make_workload
_, model, tok = load_model(None)
cfg = VariantsBenchConfig(requests=16, max_prompt_tokens=256, max_output_tokens=48, num_blocks=80)
ec = dataclasses.replace(cfg.engine_config("naive-evict", "dense"), prefix_caching=False)
items = make_workload(cfg.workload, cfg.requests, tok, seed=cfg.seed, max_prompt_tokens=256, max_output_tokens=48)
e = Engine(model, ec, tok)
for it in items:
    e.add_request(tok.encode(it.prompt, chat=True), SamplingParams(max_tokens=it.max_tokens, ignore_eos=True))
captured = {}
finish = e.kv.finish_step
def watched():
    out = finish(); captured["out"] = out; return out
e.kv.finish_step = watched
final, total = {}, 0
while e.has_unfinished():
    captured.clear()
    e.step()
    out = captured.get("out")
    if out is None:
        continue
    for i, r in enumerate(out.req_ids.tolist()):
        n = len(out.victims_of(i))
        total += n
        if e.requests[r].status is not Status.RUNNING and n:
            final[r] = n
print(f"evicted {e.kv.stats.tokens_evicted}, in the steps' outputs {total}, in a request's last iteration {sum(final.values())} "
      f"({len(final)} requests: {sorted(final)})")
