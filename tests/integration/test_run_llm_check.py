# SPDX-License-Identifier: Apache-2.0
"""``examples/trtllm/run_llm.py --check`` over the 1.2.1 doubles: each phase's LLM arguments (the
baseline armed as RoPE-only, ``env_overrides`` only where ``TorchLlmArgs`` has the field) and the
verdicts it draws from the workers' records. (Generation itself needs a GPU and TensorRT-LLM.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.integration.test_trtllm_arming import NO_FIELD
from tests.integration.test_trtllm_startup import run_client, worker_report

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "trtllm" / "run_llm.py"
_spec = importlib.util.spec_from_file_location("run_llm", SCRIPT)
run_llm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_llm)

PHASE_ARGS = f"""
import argparse, importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("run_llm", {str(SCRIPT)!r})
run_llm = importlib.util.module_from_spec(spec); spec.loader.exec_module(run_llm)
options = argparse.Namespace(policy="h2o", evict_budget="8", max_seq_len=64, tokens_per_block=4)
got = {{}}
for phase in sys.argv[1:] or run_llm.PHASES:
    args = run_llm.phase_args(phase, options, "/tmp/none.json")
    got[phase] = {{"overrides": args.get("env_overrides"), "armed": os.environ["VTOKEN_TRTLLM"],
                  "budget": json.loads(os.environ["VTOKEN_TRTLLM_SETTINGS"])["budget"]}}
import tensorrt_llm
print(json.dumps(got))
"""


def record(mode: str, steps: int) -> dict:
    return {"mode": mode, "pid": 7, "tensorrt_llm": "1.2.1", "steps": steps,
            "manager": "VTokenKVCacheManager[KVCacheManager]" if mode == "vtoken" else None}


def results(never_tokens, never_steps=5, baseline_mode="rope", evicted=4.0) -> dict:
    return {"baseline": {"tokens": [[1, 2, 3]], "record": record(baseline_mode, 0), "stats": {}},
            "never evicts": {"tokens": never_tokens, "record": record("vtoken", never_steps),
                             "stats": {"vtoken_tokens_evicted": 0.0, "vtoken_blocks_reclaimed": 0.0}},
            "evicts": {"tokens": [[9, 9]], "record": record("vtoken", 5),
                       "stats": {"vtoken_tokens_evicted": evicted, "vtoken_blocks_reclaimed": 1.0}}}


def test_phase_arguments_arm_each_worker_by_the_routes_the_build_has():
    """The baseline is armed as RoPE-only, the others as vToken; with the env_overrides field each
    gets it, without it none does (the environment, exported before the import, carries them; a
    build without the field takes one phase per process, as --check runs them)."""
    with_field = worker_report(run_client(PHASE_ARGS))
    assert [with_field[p]["armed"] for p in run_llm.PHASES] == ["rope", "1", "1"]
    assert [with_field[p]["overrides"]["VTOKEN_TRTLLM"] for p in run_llm.PHASES] == ["rope", "1", "1"]
    assert [with_field[p]["budget"] for p in run_llm.PHASES[1:]] == [64, "8"]  # never evicts: max_seq_len
    without = worker_report(run_client(PHASE_ARGS.replace("sys.argv[1:]", "['baseline']"), **NO_FIELD))
    assert without["baseline"] == {"overrides": None, "armed": "rope", "budget": 0.5}


def test_verdicts_need_vtoken_to_have_run():
    ok = run_llm.verdicts(results([[1, 2, 3]]), ["p"])
    assert all(passed for passed, _ in ok), ok
    assert any("3/3 tokens equal the baseline's" in line for _, line in ok)
    # A vToken worker that never stepped: the comparison would be vacuous.
    idle = run_llm.verdicts(results([[1, 2, 3]], never_steps=0), ["p"])
    assert [line for passed, line in idle if not passed] == [
        "never evicts: worker 7 armed as 'vtoken' (want 'vtoken'), tensorrt_llm 1.2.1, "
        "VTokenKVCacheManager[KVCacheManager], 0 vToken steps"]
    # A baseline worker that did not unfuse RoPE, a divergence, a run that never evicted.
    bad = run_llm.verdicts(results([[1, 2, 4]], baseline_mode="vtoken", evicted=0.0), ["p"])
    failed = [line for passed, line in bad if not passed]
    assert len(failed) == 3 and "2/3 tokens equal" in failed[1] and failed[2].startswith("evicts: 0 tokens")
    missing = run_llm.verdicts({**results([[1, 2, 3]]), "baseline": {"tokens": [[1, 2, 3]], "record": None,
                                                                       "stats": {}}}, ["p"])
    assert not missing[0][0] and "armed as None" in missing[0][1]


def test_help_names_the_check_and_its_phases():
    done = run_client(f"import runpy, sys; sys.argv = ['run_llm.py', '--help']; runpy.run_path({str(SCRIPT)!r}, "
                      "run_name='__main__')")
    assert "--check" in done.stdout and "--phase" in done.stdout and "RoPE unfused" in done.stdout
