"""How many of the reference engine's steps repeat their call on the real model (SmolLM2-135M-
Instruct on this CPU, 16 ShareGPT prompts, 32 new tokens each, budget 0.5, prefix caching on, the
engine's defaults otherwise), for a policy that passes no mass (StreamingLLM) and one that passes
its mass every step (H2O: since 419b1cc staged in one array rewritten in place, so its call repeats
too; before it, a new tensor each step, never repeated: real_engine_before_419b1cc.txt).

    python benchmarks/step/repeated_call/real_engine.py > benchmarks/step/repeated_call/real_engine.txt
"""

from trtllm_vtoken.cli.bench_common import load_model
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.workloads import make_workload


def main() -> None:
    _, model, tok = load_model(None)
    items = make_workload("sharegpt", 16, tok, seed=0, max_prompt_tokens=256)
    print("| policy | prefix caching | steps | call on the worker | repeated |")
    print("|---|---|---:|---:|---:|")
    for policy in ("streaming_llm", "h2o"):
        engine = Engine(model, EngineConfig(policy=policy, budget=0.5, num_blocks=2048, max_batch_size=16,
                                            max_seq_len=400), tok)
        for item in items:
            engine.add_request(tok.encode(item.prompt, chat=True), SamplingParams(max_tokens=32))
        while engine.has_unfinished():
            engine.step()
        stats = engine.kv.step_stats
        print(f"| {policy} | {'on' if engine.kv.prefix is not None else 'off'} | {stats.steps} | "
              f"{stats.overlapped_steps} | {stats.repeated_steps} |")


if __name__ == "__main__":
    main()
