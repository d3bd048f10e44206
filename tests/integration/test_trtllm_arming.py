# SPDX-License-Identifier: Apache-2.0
"""Proof of arming, end to end over the 1.2.1 doubles (a client process, its MPI-spawned worker):
the worker records that vToken is installed, and an ``LLM`` built while armed fails loudly when
its worker did not arm. Three TensorRT-LLM builds (``startup.py``'s table): a worker that applies
``env_overrides`` (the stored 1.2-era ``worker.py``), one that does not (then only the environment
exported before ``import tensorrt_llm`` reaches it), and a ``TorchLlmArgs`` without the field. The
RoPE-only baseline records itself the same way."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_trtllm_startup import run_client, worker_report
from trtllm_vtoken.integration.trtllm.arming import RECORD_KEY, read_record, worker_problem, write_record
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.integration.trtllm.environment import arm_mode
from trtllm_vtoken.integration.trtllm.stats import read_stats

IGNORES_OVERRIDES = {"TLLM_DOUBLE_WORKER_APPLIES_ENV_OVERRIDES": "0"}  # worker_main without the update
NO_FIELD = {"TLLM_DOUBLE_TORCH_LLM_ARGS_WITHOUT_ENV_OVERRIDES": "1"}  # TorchLlmArgs without env_overrides

IMPORT_FIRST = """
import json, os, sys
import tensorrt_llm  # MPI initialised: the worker environment is fixed from here on
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import vtoken_llm_args
from trtllm_vtoken.integration.trtllm.arming import read_record

path = sys.argv[1] if len(sys.argv) > 1 else ""
args = vtoken_llm_args(policy="streaming_llm", budget=16, policy_options={"n_sink": 2}, tokens_per_block=4,
                       stats_file=path)
path = json.loads(args["env_overrides"]["VTOKEN_TRTLLM_SETTINGS"])["stats_file"]
llm = LLM("tiny", **args)
print(json.dumps({"report": llm.worker_report, "record": read_record(path), "client_pid": os.getpid()}))
"""

ARGS_FIRST = """
import json, os
from trtllm_vtoken.integration.trtllm import vtoken_llm_args

args = vtoken_llm_args(policy="sliding_window", budget=12, tokens_per_block=4)  # exported, then imported
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm.arming import read_record

llm = LLM("tiny", **args)
path = json.loads(os.environ["VTOKEN_TRTLLM_SETTINGS"])["stats_file"]
try:
    vtoken_llm_args(tokens_per_block=4)  # tensorrt_llm is imported now
    late = "ok"
except RuntimeError as exc:
    late = str(exc)
print(json.dumps({"report": llm.worker_report, "record": read_record(path), "args": sorted(args), "late": late}))
"""


def test_an_armed_worker_records_itself():
    got = worker_report(run_client(IMPORT_FIRST))
    record, report = got["record"], got["report"]
    assert report["manager"] == "VTokenKVCacheManager[KVCacheManager]"
    assert record["mode"] == "vtoken" and record["manager"] == report["manager"]
    assert record["pid"] == report["pid"] != got["client_pid"]  # written in the worker
    assert record["tensorrt_llm"] == "1.2.1" and record["steps"] == 0 and record["requests_seen"] == 0
    assert (record["settings"]["policy"], record["settings"]["budget"]) == ("streaming_llm", 16)
    assert record["settings"]["stats_file"]  # vtoken_llm_args always gives the worker a stats file


def test_a_worker_that_ignores_env_overrides_fails_the_llm_loudly(tmp_path):
    """The field exists, the client sets it, the worker never applies it: TensorRT-LLM's own
    manager with fused RoPE would run. The LLM is refused with the cause and the fix; a record an
    earlier LLM left in the same stats file does not count (the client removes it first)."""
    stats_file = tmp_path / "worker.json"
    settings = VTokenSettings(policy="streaming_llm", budget=16, policy_options={"n_sink": 2}, stats_file=str(stats_file))
    write_record(stats_file, {"mode": "vtoken", "settings": json.loads(settings.to_env())})
    done = run_client(IMPORT_FIRST.replace('path = sys.argv[1] if len(sys.argv) > 1 else ""', f"path = {str(stats_file)!r}"),
                      **IGNORES_OVERRIDES)
    assert done.returncode != 0
    assert "vToken was armed for this LLM (VTOKEN_TRTLLM=1 through the env_overrides)" in done.stderr
    assert f"TensorRT-LLM's executor worker left no record in {stats_file}" in done.stderr
    assert "does not apply env_overrides" in done.stderr and "before `import tensorrt_llm`" in done.stderr
    assert not stats_file.exists()


def test_the_environment_route_arms_a_worker_that_ignores_env_overrides():
    """vtoken_llm_args before ``import tensorrt_llm``: the variables are in MPI's spawn environment."""
    got = worker_report(run_client(ARGS_FIRST, **IGNORES_OVERRIDES))
    assert got["report"]["manager"] == "VTokenKVCacheManager[KVCacheManager]"
    assert got["report"]["rope_fusion"] == [False] * 4
    assert got["record"]["mode"] == "vtoken" and got["record"]["settings"]["policy"] == "sliding_window"
    assert "env_overrides" in got["args"] and got["late"] == "ok"  # the field exists: no refusal


def test_without_the_field_only_the_environment_route_is_taken():
    """TorchLlmArgs without env_overrides: vtoken_llm_args passes none, the environment exported
    before the import arms the worker, and a call after the import is refused."""
    got = worker_report(run_client(ARGS_FIRST, **NO_FIELD))
    assert "env_overrides" not in got["args"] and got["record"]["mode"] == "vtoken"
    assert got["report"]["manager"] == "VTokenKVCacheManager[KVCacheManager]"
    assert "has no env_overrides argument and was imported before vtoken_llm_args()" in got["late"]


def test_the_rope_only_baseline_and_settings_without_a_stats_file():
    """The baseline keeps TensorRT-LLM's manager, unfuses RoPE and records itself; settings that
    name no stats file (a model.yaml's) get one from the client through env_overrides."""
    settings = VTokenSettings(policy="random", budget=10)
    code = f"""
import json
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import baseline_llm_args, llm_args_dict
from trtllm_vtoken.integration.trtllm.arming import read_record
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings

args = baseline_llm_args(tokens_per_block=4)
baseline = LLM("tiny", **args)
path = json.loads(args["env_overrides"]["VTOKEN_TRTLLM_SETTINGS"])["stats_file"]
yaml = LLM("tiny", **llm_args_dict(4, VTokenSettings.from_env({settings.worker_environment()!r})))
print(json.dumps({{"baseline": baseline.worker_report, "record": read_record(path), "yaml": yaml.worker_report}}))
"""
    got = worker_report(run_client(code))
    assert got["baseline"]["manager"] == "KVCacheManager" and got["baseline"]["rope_fusion"] == [False] * 4
    assert got["baseline"]["environ"]["VTOKEN_TRTLLM"] == "rope"
    assert got["record"]["mode"] == "rope" and got["record"]["rope_unfused_modules"] == 4
    sent = json.loads(got["yaml"]["environ"]["VTOKEN_TRTLLM_SETTINGS"])
    assert sent["stats_file"] and (sent["policy"], sent["budget"]) == ("random", 10)
    assert read_record(sent["stats_file"])["manager"] == got["yaml"]["manager"] == \
        "VTokenKVCacheManager[KVCacheManager]"


# ---- in process -------------------------------------------------------------------------------------
def test_worker_problems_are_named(tmp_path):
    settings = VTokenSettings(policy="h2o", stats_file=str(tmp_path / "s.json"))
    sent = json.loads(settings.to_env())
    assert worker_problem({"mode": "vtoken", "settings": sent}, "vtoken", settings) is None
    assert "armed as 'rope', not 'vtoken'" in worker_problem({"mode": "rope", "settings": sent}, "vtoken", settings)
    assert "with other settings" in worker_problem({"mode": "vtoken", "settings": dict(sent, budget=3)}, "vtoken",
                                                   settings)
    assert "left no record" in worker_problem(None, "vtoken", settings)


def test_the_record_travels_beside_the_counters(tmp_path):
    """The metrics reader keeps to the numbers; the record is its own object."""
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"vtoken_tokens_evicted": 3}))
    write_record(path, {"mode": "vtoken", "steps": 2})
    assert read_stats(path) == {"vtoken_tokens_evicted": 3.0}
    assert read_record(path) == {"mode": "vtoken", "steps": 2}
    assert json.loads(path.read_text())[RECORD_KEY]["steps"] == 2
    assert read_record(tmp_path / "missing.json") is None


def test_arming_values():
    assert [arm_mode({"VTOKEN_TRTLLM": v}) for v in ("1", "rope", "0", "")] == ["vtoken", "rope", None, None]
    with pytest.raises(ValueError, match=r"\$VTOKEN_TRTLLM must be 1 \(vToken on\), rope"):
        arm_mode({"VTOKEN_TRTLLM": "yes"})
    assert VTokenSettings().worker_environment("rope")["VTOKEN_TRTLLM"] == "rope"
    with pytest.raises(ValueError, match="mode must be one of"):
        VTokenSettings().worker_environment("all")


def test_the_triton_models_llm_arms_a_worker_that_ignores_env_overrides():
    """The serving loop makes vToken's arguments before it imports tensorrt_llm, so its worker
    arms by the environment route too (imported first, this build's LLM would be refused). The
    engine settings TensorRT-LLM has too reach its LLM under its names (``trtllm_options``):
    the worker builds its executor with chunked prefill, NGram drafting and block reuse off."""
    code = """
import json, pathlib, tempfile, warnings
from trtllm_vtoken.integration.trtllm.arming import read_record
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.serving.settings import ServingSettings
from trtllm_vtoken.serving.trtllm_loop import make_trtllm_loop

folder = pathlib.Path(tempfile.mkdtemp()); (folder / "config.json").write_text("{}")
warnings.simplefilter("ignore")  # drafting turns the overlap scheduler off, as TensorRT-LLM does
engine = EngineConfig(policy="sliding_window", budget=12, tokens_per_block=4, max_batch_size=4, max_seq_len=64,
                      max_num_tokens=32, enable_chunked_prefill=True, prefix_caching=False,
                      speculative_config={"max_draft_len": 2, "max_matching_ngram_size": 2})
loop = make_trtllm_loop(ServingSettings(engine, model=str(folder), backend="trtllm"))
args = loop.llm.args
print(json.dumps({"record": read_record(loop.stats_file), "manager": loop.llm.worker_report["manager"],
                  "args": [args.max_num_tokens, args.enable_chunked_prefill, args.disable_overlap_scheduler,
                           args.kv_cache_config.enable_block_reuse, args.speculative_config.decoding_type,
                           args.speculative_config.max_draft_len, args.max_batch_size]}))
loop.stop()
"""
    got = worker_report(run_client(code, **IGNORES_OVERRIDES))
    assert got["manager"] == "VTokenKVCacheManager[KVCacheManager]" == got["record"]["manager"]
    assert got["record"]["settings"]["policy"] == "sliding_window"
    assert got["args"] == [32, True, True, False, "NGram", 2, 4]
