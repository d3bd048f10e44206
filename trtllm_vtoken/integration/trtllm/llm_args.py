# SPDX-License-Identifier: Apache-2.0
"""The LLM arguments vToken needs (TensorRT-LLM 1.2.1 ``TorchLlmArgs`` names only).

    kv_cache_config            block reuse on and partial reuse on (TensorRT-LLM's defaults; prompt
                               blocks are never relocated), no host offload
    scheduler_config           MAX_UTILIZATION: GUARANTEED_NO_EVICT would reserve prompt + max_new
                               blocks per request again, so freed blocks would admit nobody
    max_beam_width             1 (rewind_kv_cache removes tokens of beam 0 only)
    attn_backend               "TRTLLM", the backend the hooks patch
    env_overrides              {$VTOKEN_TRTLLM: "1", $VTOKEN_TRTLLM_SETTINGS: json} where
                               TorchLlmArgs has the field (1.2 on); the same variables are also
                               exported in this process, for workers that do not apply it
                               (startup.py: the routes per TensorRT-LLM version)

No KV connector: a configured ``kv_connector_config`` makes ``create_py_executor`` refuse any
policy but GUARANTEED_NO_EVICT, and its module is imported after the model is built.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from trtllm_vtoken.integration.trtllm.settings import VTokenSettings, check_llm_args


def llm_args_dict(tokens_per_block: int = 32, settings: VTokenSettings | None = None) -> dict[str, Any]:
    """The LLM arguments vToken requires as plain values (``model.yaml`` keys); with ``settings``,
    also the ``env_overrides`` that arm vToken in the worker and carry them there."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    args: dict[str, Any] = {
        "kv_cache_config": {"enable_block_reuse": True, "host_cache_size": 0, "tokens_per_block": tokens_per_block},
        "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"},
        "max_beam_width": 1,
        "attn_backend": "TRTLLM",
    }
    if settings is not None:
        args["env_overrides"] = settings.worker_environment()
    check_llm_args(args)
    return args


def vtoken_llm_args(policy: str = "h2o", budget: int | float | str = 0.5, tokens_per_block: int = 32,
                    **settings: Any) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM`` with vToken's settings (policy, budget,
    ``policy_options``, ``check_invariants``, ``stats_file``, ...) bound for the executor worker.

    The settings go to the worker by both routes ``startup.py`` describes: this process's
    environment (seen by workers of an MPI initialised after this call: call it before
    ``import tensorrt_llm`` and every TensorRT-LLM gets them) and ``env_overrides`` where
    ``TorchLlmArgs`` has that field. Without a ``stats_file`` the worker's record goes to a fresh
    temporary file: the ``LLM`` built with these arguments fails if its worker did not arm
    (``arming.py``). ValueError for bad settings; RuntimeError if tensorrt_llm is not importable,
    or if it lacks ``env_overrides`` and was imported (MPI initialised) before this call.
    """
    return armed_llm_args(VTokenSettings(policy=policy, budget=budget, **settings), tokens_per_block)


def baseline_llm_args(tokens_per_block: int = 32, stats_file: str = "") -> dict[str, Any]:
    """``vtoken_llm_args``' LLM arguments for TensorRT-LLM's own KV-cache manager with RoPE unfused
    (mode "rope"): a baseline that differs from vToken's LLM by vToken alone. Its worker records
    that it armed too."""
    return armed_llm_args(VTokenSettings(stats_file=stats_file), tokens_per_block, mode="rope")


def armed_llm_args(settings: VTokenSettings, tokens_per_block: int = 32, mode: str = "vtoken") -> dict[str, Any]:
    """The LLM arguments that arm the executor worker in ``mode`` ("vtoken" or "rope") with
    ``settings`` (given a fresh stats file if they have none)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise RuntimeError("tensorrt_llm is not importable: no module named 'tensorrt_llm'")
    settings = settings.with_stats_file()
    environment = settings.worker_environment(mode)
    mpi_initialised = "tensorrt_llm" in sys.modules
    os.environ.update(environment)
    try:
        from tensorrt_llm.llmapi import llm_args as api
    except ImportError as exc:
        raise RuntimeError(f"tensorrt_llm is not importable: {exc}") from None
    plain = llm_args_dict(tokens_per_block)
    args: dict[str, Any] = {
        "kv_cache_config": api.KvCacheConfig(**plain["kv_cache_config"]),
        "scheduler_config": api.SchedulerConfig(
            capacity_scheduler_policy=api.CapacitySchedulerPolicy.MAX_UTILIZATION),
        **{key: plain[key] for key in ("max_beam_width", "attn_backend")},
    }
    if "env_overrides" in api.TorchLlmArgs.model_fields:
        args["env_overrides"] = environment
    elif mpi_initialised:
        raise RuntimeError("this TensorRT-LLM has no env_overrides argument and was imported before "
                           "vtoken_llm_args(): its MPI worker would not see vToken's settings. Call "
                           "vtoken_llm_args() before importing tensorrt_llm, or export "
                           + " and ".join(f"{k}='{v}'" for k, v in environment.items()) + " first")
    return args
