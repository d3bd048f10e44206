# SPDX-License-Identifier: Apache-2.0
"""How vToken gets into TensorRT-LLM's executor worker, over the 1.2.1 doubles (``trtllm121/``):

- the LLM arguments are real ``TorchLlmArgs`` names (``BaseLlmArgs`` forbids unknown keys);
- a KV connector cannot carry vToken (it forces GUARANTEED_NO_EVICT and is imported after the
  model is built);
- end to end, in processes as TensorRT-LLM runs them: a client that imports tensorrt_llm first
  (MPI initialised, the spawn environment fixed), ``LLM(model, **vtoken_llm_args(...))``, a worker
  spawned with that environment which processes the installed ``trtllm_vtoken_startup.pth``, gets
  the settings only through ``env_overrides``, and builds the model with RoPE unfused and the
  KV-cache manager replaced;
- armed without settings: a clear error from the worker; not armed: TensorRT-LLM untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.integration.trtllm_doubles import TRTLLM121_ROOT, TrtllmAttention
from trtllm_vtoken.integration.trtllm import check_llm_args, llm_args_dict
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings

REPO = Path(__file__).resolve().parents[2]
HOOK = Path(sysconfig.get_paths()["purelib"]) / "trtllm_vtoken_startup.pth"


def run_client(code: str, **environ: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose ``tensorrt_llm`` is the double (vToken's variables unset)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VTOKEN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TRTLLM121_ROOT), str(REPO)])
    env.update(environ)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def worker_report(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the arguments -----------------------------------------------------------------------------
def test_vtoken_llm_args_are_real_torch_llm_args(trtllm121):
    from tensorrt_llm.llmapi.llm_args import CapacitySchedulerPolicy, KvCacheConfig, TorchLlmArgs

    from trtllm_vtoken.integration.trtllm import vtoken_llm_args

    args = vtoken_llm_args(policy="streaming_llm", budget=16, policy_options={"n_sink": 2})
    assert set(args) <= set(TorchLlmArgs.model_fields)
    llm_args = TorchLlmArgs(model="m", **args)  # BaseLlmArgs(extra="forbid") would reject a wrong name
    check_llm_args(llm_args)
    assert llm_args.scheduler_config.capacity_scheduler_policy is CapacitySchedulerPolicy.MAX_UTILIZATION
    assert set(llm_args_dict()["kv_cache_config"]) <= set(KvCacheConfig.model_fields)
    assert llm_args.kv_connector_config is None and llm_args.cuda_graph_config is not None  # graphs stay on
    assert VTokenSettings.from_env(llm_args.env_overrides).policy == "streaming_llm"
    with pytest.raises(ValueError, match="connector_config\n  Extra inputs are not permitted"):
        TorchLlmArgs(model="m", connector_config={})


def test_a_kv_connector_cannot_carry_vtoken(trtllm121):
    """py_executor_creator refuses a connector unless the policy is GUARANTEED_NO_EVICT, which
    would reserve full-length blocks again; vToken's checks refuse a connector too."""
    from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    connector = {"connector_module": "json", "connector_scheduler_class": "JSONDecoder",
                 "connector_worker_class": "JSONEncoder"}
    args = TorchLlmArgs(model="m", **llm_args_dict(tokens_per_block=4), kv_connector_config=connector)
    with pytest.raises(NotImplementedError, match="only supported with guaranteed no evict scheduler policy"):
        create_py_executor(llm_args=args)
    with pytest.raises(ValueError, match="kv_connector_config must be None"):
        check_llm_args(args)


# ---- RoPE: fixed when the model is built -------------------------------------------------------
def test_rope_fusion_is_fixed_at_model_construction(monkeypatch, trtllm121):
    """Attention.__init__ reads support_fused_rope() once: a patch after the model is built (where
    a connector would apply it) leaves every module fused, and the worker-side check says so."""
    from tensorrt_llm._torch.attention_backend import trtllm as backend
    from tensorrt_llm._torch.pyexecutor.model_engine import TINY, DecoderModel
    from tensorrt_llm.mapping import Mapping

    from trtllm_vtoken.integration.trtllm.patches import check_rope_unfused

    early = DecoderModel(dict(TINY), Mapping(), "TRTLLM")
    monkeypatch.setattr(backend.TrtllmAttention, "support_fused_rope", classmethod(lambda cls: False))
    late = DecoderModel(dict(TINY), Mapping(), "TRTLLM")
    with pytest.raises(RuntimeError, match=r"RoPE unfused in every attention module, but: layers.0, layers.1, "):
        check_rope_unfused(early)
    check_rope_unfused(late)
    assert all(layer.attn.pos_embd_params is None for layer in late.layers)
    with pytest.raises(RuntimeError, match="no attention module with a rope_fusion attribute"):
        check_rope_unfused(torch.nn.Linear(2, 2))


def test_fused_rope_rotates_by_the_physical_position(trtllm121):
    """Why it matters: after a compaction (kv_len 6 for logical position 9) the fused op rotates
    the decode query by 5, the unfused module by 9, the position the cached keys were rotated at."""
    from tensorrt_llm._torch.attention_backend.interface import apply_rope
    from tensorrt_llm._torch.modules.attention import Attention

    torch.manual_seed(0)
    hidden = torch.randn(1, 32, dtype=torch.bfloat16)
    metadata = TrtllmAttention.Metadata(max_num_requests=1, request_ids=[0], prompt_lens=[4], num_contexts=0,
                                        seq_lens=torch.tensor([1]))
    metadata.kv_lens[0] = 6  # physical: 6 tokens held; the decode token's logical position is 9
    seen = {}
    for fused in (True, False):
        module = Attention(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_idx=0,
                           rope_fusion=fused)
        module.qkv_proj.weight.data.copy_(torch.ones_like(module.qkv_proj.weight))
        module(torch.tensor([9]), hidden, metadata)
        seen[fused] = module.attn.rotated_q.float()
    raw = (hidden.float() @ torch.ones(32, 32)).reshape(1, 4, 8).to(torch.bfloat16)
    torch.testing.assert_close(seen[True], apply_rope(raw, torch.tensor([5])).float())
    torch.testing.assert_close(seen[False], apply_rope(raw, torch.tensor([9])).float())


# ---- end to end: client, MPI-spawned worker, start-up hook --------------------------------------
def test_the_start_up_hook_is_installed_with_the_package():
    """A .pth runs only from site-packages itself: the package install puts it there."""
    assert HOOK.is_file(), f"{HOOK} missing: reinstall the package (scripts/setup_env.sh)"
    assert HOOK.read_text().strip() == "import trtllm_vtoken.integration.trtllm.startup"


CLIENT = """
import json
import tensorrt_llm  # MPI initialised: what the worker inherits is fixed from here on
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import vtoken_llm_args

llm = LLM("tiny", **vtoken_llm_args(policy="streaming_llm", budget=16, policy_options={"n_sink": 2},
                                    tokens_per_block=4))
print(json.dumps(llm.worker_report))
"""


def test_vtoken_reaches_the_mpi_worker_before_the_model_is_built():
    report = worker_report(run_client(CLIENT))
    assert report["pid"] != os.getpid()
    assert report["manager"] == "VTokenKVCacheManager[KVCacheManager]"
    assert report["rope_fusion"] == [False] * 4  # patched before PyTorchModelEngine built the model
    assert (report["policy"], report["budget"]) == ("streaming_llm", 16)  # the settings, not defaults
    assert report["environ"]["VTOKEN_TRTLLM"] == "1" and report["pool_dtype"] == "torch.bfloat16"


def test_armed_without_settings_is_a_clear_error():
    """In the client, which checks an armed LLM's settings before any worker starts (a worker that
    sees only the variable raises the same, ``VTokenSettings.from_env``)."""
    code = """
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import llm_args_dict

LLM("tiny", **llm_args_dict(tokens_per_block=4), env_overrides={"VTOKEN_TRTLLM": "1"})
"""
    done = run_client(code)
    assert done.returncode != 0
    assert "vToken is armed ($VTOKEN_TRTLLM=1) in process" in done.stderr
    assert "but $VTOKEN_TRTLLM_SETTINGS is not set" in done.stderr


def test_exported_before_python_starts_reaches_the_worker_too():
    """The other route: variables in the environment MPI captures (e.g. a Docker ENV)."""
    settings = VTokenSettings(policy="sliding_window", budget=12)
    code = """
import json
from tensorrt_llm import LLM
from trtllm_vtoken.integration.trtllm import llm_args_dict

print(json.dumps(LLM("tiny", **llm_args_dict(tokens_per_block=4)).worker_report))
"""
    report = worker_report(run_client(code, **settings.worker_environment()))
    assert (report["manager"], report["policy"], report["budget"]) == (
        "VTokenKVCacheManager[KVCacheManager]", "sliding_window", 12)


def test_not_armed_leaves_tensorrt_llm_untouched():
    code = """
import json
from tensorrt_llm import LLM

print(json.dumps(LLM("tiny", kv_cache_config={"enable_block_reuse": False}).worker_report))
"""
    report = worker_report(run_client(code))
    assert report["manager"] == "KVCacheManager" and report["rope_fusion"] == [True] * 4
    assert report["environ"] == {}


def test_run_llm_example_explains_itself():
    """The GPU runner's options are documented; without tensorrt_llm it says so (exit 2)."""
    script = str(REPO / "examples" / "trtllm" / "run_llm.py")
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--check" in helped.stdout and "--evict-budget" in helped.stdout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    missing = subprocess.run([sys.executable, script, "some-model", "--check"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert missing.returncode == 2 and "tensorrt_llm is not installed" in missing.stderr
