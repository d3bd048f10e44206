# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/py_executor_creator.py`` ``create_py_executor(llm_args,
checkpoint_dir, tokenizer, ...)`` in its real construction order (1.2-era copies, index ids
4285525045, 1083207948, 3245286861):

    0. a speculative_config whose mode does not support the overlap scheduler (NGram) turns it
       off: "Disable overlap scheduler for speculation mode NGRAM" (a warning)
    1. PyTorchModelEngine(model_path=..., llm_args=..., mapping=..., spec_config=...)   the model is built
    2. if llm_args.kv_connector_config: unless the capacity scheduler policy is GUARANTEED_NO_EVICT,
       NotImplementedError("KV connector is only supported with guaranteed no evict scheduler
       policy."); then importlib.import_module(connector_module) and its two classes
    3. KvCacheCreator(...); try_prepare_estimation(); build_managers(resources, estimating)
       (get_kv_cache_manager_cls -> the manager, a small one sized for the estimation run)
    4. with a speculative_config: the spec resource manager (NGram: NGramPoolManager) joins the
       resources and the drafter (NGramDrafter over it) is made (get_spec_resource_manager,
       get_spec_drafter); create_py_executor_instance(...): PyExecutor.__init__ warms the model
       engine up
    5. estimating: configure_kv_cache_capacity(py_executor) runs KvCacheCreator's dummy requests
       (max_tokens=1) through the executor loop; teardown_managers; the estimation executor goes;
       build_managers(resources, False) with the final capacity; the engine's attention metadata
       is dropped; create_py_executor_instance again (a second warm-up)
Returns the executor."""

from __future__ import annotations

import importlib
import logging

from ... import _utils
from ...llmapi.llm_args import CapacitySchedulerPolicy
from ...mapping import Mapping
from ._util import KvCacheCreator, create_py_executor_instance
from ..speculative.ngram import NGramDrafter, NGramPoolManager
from .model_engine import PyTorchModelEngine


def create_py_executor(llm_args, checkpoint_dir=None, tokenizer=None, profiling_stage_data=None):
    tp, pp = llm_args.tensor_parallel_size, llm_args.pipeline_parallel_size
    mapping = Mapping(world_size=tp * pp, rank=_utils.mpi_rank(), tp_size=tp, pp_size=pp)
    spec_config = llm_args.speculative_config
    if spec_config is not None and not llm_args.disable_overlap_scheduler and \
            not spec_config.spec_dec_mode.support_overlap_scheduler():
        logging.getLogger("tensorrt_llm").warning(
            "Disable overlap scheduler for speculation mode %s", spec_config.spec_dec_mode.name)
        llm_args.disable_overlap_scheduler = True
    model_engine = PyTorchModelEngine(model_path=checkpoint_dir, llm_args=llm_args, mapping=mapping,
                                      spec_config=spec_config)
    connector = llm_args.kv_connector_config
    if connector is not None:
        if llm_args.scheduler_config.capacity_scheduler_policy != CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
            raise NotImplementedError("KV connector is only supported with guaranteed no evict scheduler policy.")
        module = importlib.import_module(connector.connector_module)
        getattr(module, connector.connector_worker_class)
        getattr(module, connector.connector_scheduler_class)
    resources: dict = {}
    max_batch_size = llm_args.max_batch_size
    creator = KvCacheCreator(model_engine=model_engine, mapping=mapping, kv_cache_config=llm_args.kv_cache_config,
                             max_seq_len=model_engine.max_seq_len, max_batch_size=max_batch_size,
                             tokens_per_block=llm_args.kv_cache_config.tokens_per_block,
                             max_beam_width=llm_args.max_beam_width, max_num_tokens=model_engine.max_num_tokens,
                             llm_args=llm_args)
    estimating = creator.try_prepare_estimation()
    creator.build_managers(resources, estimating)
    instance = dict(model_engine=model_engine, mapping=mapping, llm_args=llm_args, max_seq_len=model_engine.max_seq_len,
                    max_batch_size=max_batch_size, max_num_tokens=model_engine.max_num_tokens)
    if spec_config is not None:
        pool = NGramPoolManager(spec_config, max_batch_size)
        resources["spec_resource_manager"] = pool
        instance["drafter"] = NGramDrafter(spec_config, pool)
    py_executor = create_py_executor_instance(resources=resources, **instance)
    if estimating:
        creator.configure_kv_cache_capacity(py_executor)
        creator.teardown_managers(resources)
        del py_executor
        creator.build_managers(resources, False)
        if spec_config is not None:
            resources["spec_resource_manager"] = instance["drafter"].spec_resource_manager
        model_engine.attn_metadata = None
        model_engine.padding_dummy_request = None
        py_executor = create_py_executor_instance(resources=resources, **instance)
    return py_executor
