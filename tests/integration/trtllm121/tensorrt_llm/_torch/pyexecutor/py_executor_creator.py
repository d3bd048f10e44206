# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/py_executor_creator.py`` ``create_py_executor(llm_args,
checkpoint_dir, tokenizer, ...)`` in its real construction order (1.2-era copy, index id
4285525045; the same order in the other stored versions, e.g. 3245286861, 1083207948):

    1. PyTorchModelEngine(model_path=..., llm_args=..., mapping=...)   the model is built
    2. if llm_args.kv_connector_config: unless the capacity scheduler policy is GUARANTEED_NO_EVICT,
       NotImplementedError("KV connector is only supported with guaranteed no evict scheduler
       policy."); then importlib.import_module(connector_module) and its two classes
    3. KvCacheCreator(...).build_managers(resources)      get_kv_cache_manager_cls -> the manager
Returns the executor (here: its model engine and resources)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

from ... import _utils
from ...llmapi.llm_args import CapacitySchedulerPolicy
from ...mapping import Mapping
from ._util import KvCacheCreator
from .model_engine import PyTorchModelEngine


def create_py_executor(llm_args, checkpoint_dir=None, tokenizer=None, profiling_stage_data=None):
    tp, pp = llm_args.tensor_parallel_size, llm_args.pipeline_parallel_size
    mapping = Mapping(world_size=tp * pp, rank=_utils.mpi_rank(), tp_size=tp, pp_size=pp)
    model_engine = PyTorchModelEngine(model_path=checkpoint_dir, llm_args=llm_args, mapping=mapping)
    connector = llm_args.kv_connector_config
    if connector is not None:
        if llm_args.scheduler_config.capacity_scheduler_policy != CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
            raise NotImplementedError("KV connector is only supported with guaranteed no evict scheduler policy.")
        module = importlib.import_module(connector.connector_module)
        getattr(module, connector.connector_worker_class)
        getattr(module, connector.connector_scheduler_class)
    resources: dict = {}
    KvCacheCreator(model_engine=model_engine, mapping=mapping, kv_cache_config=llm_args.kv_cache_config,
                   max_seq_len=model_engine.max_seq_len, max_batch_size=llm_args.max_batch_size,
                   tokens_per_block=llm_args.kv_cache_config.tokens_per_block, max_beam_width=llm_args.max_beam_width,
                   max_num_tokens=model_engine.max_num_tokens, llm_args=llm_args).build_managers(resources)
    return SimpleNamespace(model_engine=model_engine, resources=resources)
