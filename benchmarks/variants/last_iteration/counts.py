"""Tokens evicted by naive-evict at ``vtoken bench variants --quick``'s sizes with prefix caching
off, and the moves and evictions of ``vtoken bench sweeps``' point tokens_per_block 32, vToken dense,
in the tree this imports. Prints one JSON line.

    python benchmarks/variants/last_iteration/counts.py
    python benchmarks/variants/last_iteration/in_tree.py TREE benchmarks/variants/last_iteration/counts.py
"""

import dataclasses
import json

from trtllm_vtoken.bench.sweeps import SweepsBenchConfig
from trtllm_vtoken.bench.variants import VariantsBenchConfig, serve_workload
from trtllm_vtoken.cli.bench_common import load_model
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.workloads import make_workload


def served(cfg, engine_config, model, tok):
    items = make_workload(cfg.workload, cfg.requests, tok, seed=cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens,
                          max_output_tokens=cfg.max_output_tokens)
    prompts = [tok.encode(item.prompt, chat=True) for item in items]
    engine = Engine(model, engine_config, tok)
    result, outputs = serve_workload(engine, prompts, items, None)
    return result, outputs


def main() -> None:
    _, model, tok = load_model(None)
    variants = VariantsBenchConfig(requests=16, max_prompt_tokens=256, max_output_tokens=48, num_blocks=80)
    engine_config = variants.engine_config("naive-evict", "dense")
    if any(f.name == "prefix_caching" for f in dataclasses.fields(engine_config)):
        engine_config = dataclasses.replace(engine_config, prefix_caching=False)
    naive, outputs = served(variants, engine_config, model, tok)
    sweeps = SweepsBenchConfig()
    point, _ = served(sweeps, sweeps.engine_config(tokens_per_block=32, variant="vtoken"), model, tok)
    print(json.dumps({"variants naive-evict evicted": naive["tokens_evicted"],
                      "variants output tokens": sum(map(len, outputs)),
                      "sweeps tpb 32 dense moves": point["moves"],
                      "sweeps tpb 32 dense evicted": point["tokens_evicted"]}))


if __name__ == "__main__":
    main()
