"""Tokens evicted per variant of ``vtoken bench variants --quick`` with prefix caching off and on.

A token in a block that another running request also holds is kept on top of the budget, so with
prefix caching (the engine's default) the evictions follow the schedule: variants that run
different requests at once protect different blocks at different steps. Off, every evicting
variant evicts the same tokens.

    python benchmarks/variants/evictions_by_caching.py > benchmarks/variants/evictions_by_caching.txt
"""

import dataclasses

from trtllm_vtoken.bench.variants import VariantsBenchConfig, run_variants_bench
from trtllm_vtoken.cli.bench_common import load_model


@dataclasses.dataclass(frozen=True)
class CachingConfig(VariantsBenchConfig):
    """The bench's settings with prefix caching set (the engine's default: on)."""

    prefix_caching: bool = True

    def engine_config(self, variant: str, mode: str):
        return dataclasses.replace(super().engine_config(variant, mode), prefix_caching=self.prefix_caching)


def main() -> None:
    _, model, tokenizer = load_model(None)
    print("| prefix caching | variant | mode | tokens evicted | max running | = naive-evict |")
    print("|---|---|---|---:|---:|---:|")
    for caching in (False, True):
        # The quick form's sizes (cli/bench.py run_variants) and the CLI's default batch bound, 32.
        cfg = CachingConfig(requests=16, max_prompt_tokens=256, max_output_tokens=48, num_blocks=80,
                            prefix_caching=caching)
        for run in run_variants_bench(cfg, model, tokenizer)["runs"]:
            same = run.get("exact_match_vs_naive_evict")
            print(f"| {'on' if caching else 'off'} | {run['variant']} | {run['mode']} | {run['tokens_evicted']:,} | "
                  f"{run['max_running']} | {'-' if same is None else f'{100 * same:.0f}%'} |", flush=True)


if __name__ == "__main__":
    main()
