# The reference engine on the real model (SmolLM2-135M-Instruct, CPU): 16 ShareGPT prompts, H2O 0.5,
# 32 new tokens each, prefix caching on (the default), with the step's call at once and beside
# sampling, in alternating rounds; wall seconds per run, the steps the host's thread registered
# (SlotMap.add_tokens; from c5480ef the call beside sampling registers the batch itself), and
# whether the outputs equal the round's run at once. Run from the repository root:
#     python benchmarks/step/overlap_real/run.py > benchmarks/step/overlap_real/runs.jsonl
import time, json, sys
from trtllm_vtoken.cli.bench_common import load_model
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.workloads import make_workload
_, model, tok = load_model(None)
items = make_workload("sharegpt", 16, tok, seed=0, max_prompt_tokens=256)
prompts = [tok.encode(i.prompt, chat=True) for i in items]
for rnd in range(3):
    for overlap in (False, True):
        e = Engine(model, EngineConfig(policy="h2o", budget=0.5, num_blocks=2048, max_batch_size=16, max_seq_len=400, step_overlap=overlap), tok)
        slots, registered = e.kv.step.slots, [0]
        add_tokens = slots.add_tokens
        def counted(*args, add_tokens=add_tokens, registered=registered):
            registered[0] += 1
            return add_tokens(*args)
        slots.add_tokens = counted
        ids = [e.add_request(p, SamplingParams(max_tokens=32)) for p in prompts]
        t = time.perf_counter(); n = 0
        while e.has_unfinished(): e.step(); n += 1
        dt = time.perf_counter() - t
        outputs = [e.requests[r].output_ids for r in ids]
        if not overlap:
            at_once = outputs
        print(json.dumps(dict(rnd=rnd, overlap=overlap, seconds=round(dt, 2), steps=n, overlapped=e.kv.step_stats.overlapped_steps,
                              registered_on_host=registered[0], same_outputs_as_at_once=outputs == at_once)), flush=True)
