# SPDX-License-Identifier: Apache-2.0
"""Proof of arming, end to end over the 1.2.1 doubles (a client process, its MPI-spawned worker):
the worker records that vToken is installed, and an ``LLM`` built while armed fails loudly when
its worker did not arm -- e.g. a worker that does not apply ``env_overrides``, where only the
environment exported before ``import tensorrt_llm`` reaches it. The RoPE-only baseline records
itself the same way."""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.test_trtllm_startup import run_client, worker_report
from trtllm_vtoken.integration.trtllm.arming import RECORD_KEY, read_record, worker_problem, write_record
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.integration.trtllm.stats import read_stats

IGNORES_OVERRIDES = {"TLLM_DOUBLE_WORKER_APPLIES_ENV_OVERRIDES": "0"}  # a worker without the update

IMPORT_FIRST = """
import json, os
import tensorrt_llm  # MPI initialised: the worker environment is fixed from here on
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import vtoken_llm_args
from trtllm_vtoken.integration.trtllm.arming import read_record

args = vtoken_llm_args(policy="streaming_llm", budget=16, policy_options={"n_sink": 2}, tokens_per_block=4)
path = os.environ["VTOKEN_TRTLLM_SETTINGS"] and json.loads(os.environ["VTOKEN_TRTLLM_SETTINGS"])["stats_file"]
llm = LLM("tiny", **args)
print(json.dumps({"report": llm.worker_report, "record": read_record(path), "client_pid": os.getpid()}))
"""

ARGS_FIRST = """
import json, os
from trtllm_vtoken.integration.trtllm import vtoken_llm_args

args = vtoken_llm_args(policy="sliding_window", budget=12, tokens_per_block=4)  # exported, then imported
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm.arming import read_record

path = json.loads(args["env_overrides"]["VTOKEN_TRTLLM_SETTINGS"])["stats_file"]
llm = LLM("tiny", **args)
print(json.dumps({"report": llm.worker_report, "record": read_record(path), "client_pid": os.getpid()}))
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


def test_a_worker_that_ignores_env_overrides_fails_the_llm_loudly():
    """The field exists, the client sets it, the worker never applies it: TensorRT-LLM's own
    manager with fused RoPE would run. The LLM is refused with the cause and the fix."""
    done = run_client(IMPORT_FIRST, **IGNORES_OVERRIDES)
    assert done.returncode != 0
    assert "vToken was armed for this LLM (VTOKEN_TRTLLM=1 through the env_overrides)" in done.stderr
    assert "TensorRT-LLM's executor worker left no record in" in done.stderr
    assert "does not apply env_overrides" in done.stderr and "before `import tensorrt_llm`" in done.stderr


def test_the_environment_route_arms_a_worker_that_ignores_env_overrides():
    """vtoken_llm_args before ``import tensorrt_llm``: the variables are in MPI's spawn environment."""
    got = worker_report(run_client(ARGS_FIRST, **IGNORES_OVERRIDES))
    assert got["report"]["manager"] == "VTokenKVCacheManager[KVCacheManager]"
    assert got["report"]["rope_fusion"] == [False] * 4
    assert got["record"]["mode"] == "vtoken" and got["record"]["settings"]["policy"] == "sliding_window"


def test_the_rope_only_baseline_records_itself_and_keeps_tensorrt_llms_manager():
    code = """
import json
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import baseline_llm_args
from trtllm_vtoken.integration.trtllm.arming import read_record

args = baseline_llm_args(tokens_per_block=4)
llm = LLM("tiny", **args)
path = json.loads(args["env_overrides"]["VTOKEN_TRTLLM_SETTINGS"])["stats_file"]
print(json.dumps({"report": llm.worker_report, "record": read_record(path)}))
"""
    got = worker_report(run_client(code))
    assert got["report"]["manager"] == "KVCacheManager" and got["report"]["rope_fusion"] == [False] * 4
    assert got["record"]["mode"] == "rope" and got["record"]["rope_unfused_modules"] == 4
    assert got["report"]["environ"]["VTOKEN_TRTLLM"] == "rope"


def test_settings_without_a_stats_file_get_one_through_env_overrides():
    """A model.yaml's settings name no stats file: the client gives the worker one to record in."""
    settings = VTokenSettings(policy="random", budget=10)
    code = f"""
import json
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import llm_args_dict
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings

llm = LLM("tiny", **llm_args_dict(4, VTokenSettings.from_env({settings.worker_environment()!r})))
print(json.dumps(llm.worker_report))
"""
    report = worker_report(run_client(code))
    sent = json.loads(report["environ"]["VTOKEN_TRTLLM_SETTINGS"])
    assert sent["stats_file"] and (sent["policy"], sent["budget"]) == ("random", 10)
    assert read_record(sent["stats_file"])["mode"] == "vtoken"


def test_an_old_record_does_not_count(tmp_path):
    """The client removes the stats file before construction: a record from an earlier LLM proves
    nothing (here the worker ignores env_overrides and so never writes a new one)."""
    stats_file = tmp_path / "worker.json"
    settings = VTokenSettings(stats_file=str(stats_file))
    write_record(stats_file, {"mode": "vtoken", "settings": json.loads(settings.to_env())})
    code = f"""
import tensorrt_llm
from trtllm_vtoken.integration.trtllm import vtoken_llm_args

tensorrt_llm.LLM("tiny", **vtoken_llm_args(tokens_per_block=4, stats_file={str(stats_file)!r}))
"""
    done = run_client(code, **IGNORES_OVERRIDES)
    assert done.returncode != 0 and "left no record in" in done.stderr
    assert not stats_file.exists()


def test_worker_problems_are_named(tmp_path):
    settings = VTokenSettings(policy="h2o", stats_file=str(tmp_path / "s.json"))
    sent = json.loads(settings.to_env())
    assert worker_problem({"mode": "vtoken", "settings": sent}, "vtoken", settings) is None
    assert "armed as 'rope', not 'vtoken'" in worker_problem({"mode": "rope", "settings": sent}, "vtoken", settings)
    other = dict(sent, budget=3)
    assert "with other settings" in worker_problem({"mode": "vtoken", "settings": other}, "vtoken", settings)
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


@pytest.mark.parametrize("value", ["yes", "2"])
def test_an_unknown_arming_value_is_an_error(value):
    done = run_client("import tensorrt_llm; tensorrt_llm.LLM('tiny', env_overrides={'VTOKEN_TRTLLM': '%s'})" % value)
    assert done.returncode != 0 and "$VTOKEN_TRTLLM must be 1 (vToken on), rope" in done.stderr


def test_not_armed_leaves_no_record_and_no_check(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VTOKEN_")}
    assert "VTOKEN_TRTLLM" not in env
    report = worker_report(run_client("import json, tensorrt_llm; "
                                      "print(json.dumps(tensorrt_llm.LLM('tiny').worker_report))"))
    assert report["manager"] == "KVCacheManager" and report["environ"] == {}
