# SPDX-License-Identifier: Apache-2.0
"""vToken inside TensorRT-LLM's PyTorch backend (1.2.1): one entry for users.

    from tensorrt_llm import LLM
    from trtllm_vtoken.integration.trtllm import vtoken_llm_args

    llm = LLM(model, **vtoken_llm_args(policy="h2o", budget=0.5))

``vtoken_llm_args`` exports vToken's settings to the executor worker ($VTOKEN_TRTLLM_SETTINGS)
and returns the LLM arguments the hooks need, with the connector that installs them in the
worker. ``llm_args_dict`` is the same as plain values, for a Triton ``model.yaml``. Nothing here
imports tensorrt_llm until ``vtoken_llm_args`` builds its config objects.
"""

from __future__ import annotations

import os
from typing import Any

from trtllm_vtoken.integration.trtllm.settings import ENV_VAR, VTokenSettings, check_llm_args

CONNECTOR = {
    "connector_module": "trtllm_vtoken.integration.trtllm.connector",
    "connector_scheduler_class": "VTokenConnectorScheduler",
    "connector_worker_class": "VTokenConnectorWorker",
}

__all__ = ["CONNECTOR", "VTokenSettings", "check_llm_args", "llm_args_dict", "vtoken_llm_args"]


def llm_args_dict(tokens_per_block: int = 32) -> dict[str, Any]:
    """The LLM arguments vToken requires, as plain values (``model.yaml`` keys)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    args = {
        "kv_cache_config": {"enable_block_reuse": False, "enable_partial_reuse": False,
                            "host_cache_size": 0, "tokens_per_block": tokens_per_block},
        "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"},
        "disable_overlap_scheduler": True,
        "max_beam_width": 1,
        "enable_chunked_prefill": False,
        "connector_config": dict(CONNECTOR),
    }
    check_llm_args(args)
    return args


def vtoken_llm_args(policy: str = "h2o", budget: int | float | str = 0.5, tokens_per_block: int = 32,
                    **settings: Any) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM``; also exports the vToken settings (policy,
    budget, ``policy_options``, ``check_invariants``, ``stats_file``) to the worker through the
    environment.
    Raises ValueError for bad settings, RuntimeError if tensorrt_llm is not importable."""
    chosen = VTokenSettings(policy=policy, budget=budget, **settings)
    try:
        from tensorrt_llm.llmapi import llm_args as api
    except ImportError as exc:
        raise RuntimeError(f"tensorrt_llm is not importable: {exc}") from None
    plain = llm_args_dict(tokens_per_block)
    os.environ[ENV_VAR] = chosen.to_env()
    return {
        "kv_cache_config": api.KvCacheConfig(**plain["kv_cache_config"]),
        "scheduler_config": api.SchedulerConfig(
            capacity_scheduler_policy=api.CapacitySchedulerPolicy.MAX_UTILIZATION),
        "disable_overlap_scheduler": True,
        "max_beam_width": 1,
        "enable_chunked_prefill": False,
        "connector_config": api.KvCacheConnectorConfig(**CONNECTOR),
    }
