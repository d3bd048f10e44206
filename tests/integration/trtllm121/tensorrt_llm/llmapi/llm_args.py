# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/llmapi/llm_args.py`` (1.2-era copy, index id 7019226376: the one with
``env_overrides``, ``layer_wise_benchmarks_config``, ``use_kv_cache_manager_v2=False``).

What it imitates:
- ``StrictBaseModel`` / ``BaseLlmArgs`` (``model_config = ConfigDict(..., extra="forbid")``):
  an unknown key is a validation error (a ``ValueError``), in every config class.
- The field names of ``BaseLlmArgs`` + ``TorchLlmArgs`` and of ``KvCacheConfig``,
  ``SchedulerConfig``, ``CudaGraphConfig``, ``KvCacheConnectorConfig``, with the real defaults
  of those vToken depends on: ``KvCacheConfig.enable_block_reuse = True``,
  ``enable_partial_reuse = True``, ``tokens_per_block = 32``; ``SchedulerConfig``'s
  ``capacity_scheduler_policy = GUARANTEED_NO_EVICT``; ``TorchLlmArgs.cuda_graph_config`` built
  by default (``default_factory=CudaGraphConfig``: graphs on); ``disable_overlap_scheduler =
  False``; ``attn_backend = "TRTLLM"``; ``max_beam_width = 1``; ``kv_connector_config = None``.
- pydantic's coercion of nested dicts (``kv_cache_config={...}``) and enum names ("MAX_UTILIZATION").
- ``coerce_env_overrides_to_str``: ``env_overrides`` values become strings.
- ``TorchLlmArgs.model_fields``, the pydantic v2 class attribute listing the fields.
- ``NGramDecodingConfig`` (``DecodingBaseConfig`` fields, ``decoding_type = "NGram"``,
  ``max_matching_ngram_size = 2``, ``is_keep_all``, ``is_use_oldest``, ``is_public_pool`` all True;
  ``max_total_draft_tokens`` defaults to ``max_draft_len``) as ``speculative_config``, a dict with
  ``decoding_type: NGram`` validated into it; its ``spec_dec_mode`` (``speculative/interface.py``,
  index ids 2550156383, 735060080): NGram needs a KV-cache rewind, does not support the overlap
  scheduler, and ``extend_ctx`` (its rows with drafts as context rows) depends on the GPU.
  Other decoding types are not modelled.
An older build is modelled too: with ``TLLM_DOUBLE_TORCH_LLM_ARGS_WITHOUT_ENV_OVERRIDES=1`` in the
environment at import, ``BaseLlmArgs`` has no ``env_overrides`` field (the 1.1-era copy, index id
1090804222: ``orchestrator_type`` is its last public field), so passing it is an unknown key.
"""

from __future__ import annotations

import enum
import os
from typing import Any, ClassVar


class CapacitySchedulerPolicy(str, enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class StrictBaseModel:
    """Fields with defaults in ``FIELDS``; ``NESTED`` maps a field to the config class a dict
    value is validated into. Unknown keys: ``ValueError`` (pydantic's "Extra inputs are not
    permitted")."""

    FIELDS: ClassVar[dict[str, Any]] = {}
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    NESTED: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.model_fields = dict.fromkeys(cls.FIELDS)  # what pydantic v2 exposes (values elided)

    def __init__(self, **values: Any) -> None:
        extra = sorted(set(values) - set(self.FIELDS))
        missing = [name for name in self.REQUIRED if name not in values]
        if extra or missing:
            lines = [f"{name}\n  Extra inputs are not permitted" for name in extra]
            lines += [f"{name}\n  Field required" for name in missing]
            raise ValueError(f"{len(lines)} validation error(s) for {type(self).__name__}\n" + "\n".join(lines))
        for name, default in self.FIELDS.items():
            value = values.get(name, default() if callable(default) and isinstance(default, type) else default)
            nested = self.NESTED.get(name)
            if nested is not None and isinstance(value, dict):
                value = nested(**value)
            setattr(self, name, self._validate(name, value))

    def _validate(self, name: str, value: Any) -> Any:
        return value

    def model_dump(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.FIELDS}


class KvCacheConfig(StrictBaseModel):
    FIELDS = {
        "enable_block_reuse": True, "max_tokens": None, "max_attention_window": None,
        "sink_token_length": None, "free_gpu_memory_fraction": 0.9, "host_cache_size": None,
        "onboard_blocks": True, "cross_kv_cache_fraction": None, "secondary_offload_min_priority": None,
        "event_buffer_max_size": 0, "attention_dp_events_gather_period_ms": 5, "enable_partial_reuse": True,
        "copy_on_partial_reuse": True, "use_uvm": False, "max_gpu_total_bytes": 0, "dtype": "auto",
        "mamba_ssm_cache_dtype": "auto", "tokens_per_block": 32, "use_kv_cache_manager_v2": False,
        "max_util_for_resume": 0.95,
    }


class SchedulerConfig(StrictBaseModel):
    FIELDS = {"capacity_scheduler_policy": CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
              "context_chunking_policy": None, "dynamic_batch_config": None, "waiting_queue_policy": "FCFS"}

    def _validate(self, name: str, value: Any) -> Any:
        if name == "capacity_scheduler_policy":
            return CapacitySchedulerPolicy(value)  # ValueError for an unknown policy name
        return value


class CudaGraphConfig(StrictBaseModel):
    FIELDS = {"batch_sizes": None, "max_batch_size": 0, "enable_padding": False}


class KvCacheConnectorConfig(StrictBaseModel):
    FIELDS = {"connector_module": None, "connector_scheduler_class": None, "connector_worker_class": None}
    REQUIRED = ("connector_module", "connector_scheduler_class", "connector_worker_class")


class SpeculativeDecodingMode(enum.Enum):
    NGRAM = "NGRAM"

    def needs_kv_cache_rewind(self) -> bool:
        return self == SpeculativeDecodingMode.NGRAM

    def support_overlap_scheduler(self) -> bool:
        return False  # MTP / Eagle3 one-model and draft-model modes only, none of them modelled

    def use_one_engine(self) -> bool:
        return False  # NGram drafts beside the target's engine

    def extend_ctx(self, attention_backend) -> bool:
        """Whether the model engine runs generation rows with drafts as chunked context rows
        (``num_contexts`` counts them). ``speculative/interface.py``: copies index ids 735060080 and
        2550156383 return ``not issubclass(backend, TrtllmAttention) or get_sm_version() != 100``
        (only Blackwell's XQA kernels take the drafts as generation rows), later ones test
        ``get_sm_version() < 120`` (index ids 4078530504, 10039271475). Which one 1.2.1 ships is not
        established, and Ampere is extended under both: vToken must take either way
        (``TLLM_DOUBLE_SM_VERSION`` 90 extends here, 100 does not)."""
        from .._torch.attention_backend.trtllm import TrtllmAttention
        from .._utils import get_sm_version

        if self.use_one_engine():
            return False
        return not issubclass(attention_backend, TrtllmAttention) or get_sm_version() != 100


class NGramDecodingConfig(StrictBaseModel):
    FIELDS = {"max_draft_len": None, "max_total_draft_tokens": None, "speculative_model": None,
              "max_concurrency": None, "load_format": None, "decoding_type": "NGram", "max_matching_ngram_size": 2,
              "is_keep_all": True, "is_use_oldest": True, "is_public_pool": True}

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if self.decoding_type != "NGram":
            raise ValueError(f"decoding_type\n  Input should be 'NGram' (got {self.decoding_type!r})")
        if self.max_total_draft_tokens is None:
            self.max_total_draft_tokens = self.max_draft_len

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        return SpeculativeDecodingMode.NGRAM


_BASE_LLM_ARGS = {
    "model": None, "tokenizer": None, "tokenizer_mode": "auto", "custom_tokenizer": None,
    "skip_tokenizer_init": False, "trust_remote_code": False, "tensor_parallel_size": 1, "dtype": "auto",
    "revision": None, "tokenizer_revision": None, "model_kwargs": None, "pipeline_parallel_size": 1,
    "context_parallel_size": 1, "gpus_per_node": None, "moe_cluster_parallel_size": None,
    "moe_tensor_parallel_size": None, "moe_expert_parallel_size": None, "enable_attention_dp": False,
    "enable_lm_head_tp_in_adp": False, "pp_partition": None, "cp_config": None, "load_format": "auto",
    "enable_lora": False, "lora_config": None, "kv_cache_config": KvCacheConfig, "enable_chunked_prefill": False,
    "guided_decoding_backend": None, "batched_logits_processor": None, "iter_stats_max_iterations": None,
    "request_stats_max_iterations": None, "peft_cache_config": None, "scheduler_config": SchedulerConfig,
    "cache_transceiver_config": None, "sparse_attention_config": None, "speculative_config": None,
    "max_batch_size": 2048, "max_input_len": 1024, "max_seq_len": None, "max_beam_width": 1,
    "max_num_tokens": 8192, "gather_generation_logits": False, "num_postprocess_workers": 0,
    "postprocess_tokenizer_dir": None, "reasoning_parser": None, "decoding_config": None, "mpi_session": None,
    "otlp_traces_endpoint": None, "backend": None, "return_perf_metrics": False, "perf_metrics_max_requests": 0,
    "orchestrator_type": None, "env_overrides": None,
}
if os.environ.get("TLLM_DOUBLE_TORCH_LLM_ARGS_WITHOUT_ENV_OVERRIDES") == "1":
    del _BASE_LLM_ARGS["env_overrides"]
_TORCH_LLM_ARGS = {
    "garbage_collection_gen0_threshold": 20000, "cuda_graph_config": CudaGraphConfig, "attention_dp_config": None,
    "disable_overlap_scheduler": False, "moe_config": None, "nvfp4_gemm_config": None, "attn_backend": "TRTLLM",
    "sampler_type": "auto", "sampler_force_async_worker": False, "enable_iter_perf_stats": False,
    "enable_iter_req_stats": False, "print_iter_log": False, "batch_wait_timeout_ms": 0,
    "batch_wait_timeout_iters": 0, "batch_wait_max_tokens_ratio": 0, "torch_compile_config": None,
    "enable_autotuner": True, "enable_layerwise_nvtx_marker": False, "enable_min_latency": False,
    "stream_interval": 1, "force_dynamic_quantization": False, "allreduce_strategy": "AUTO",
    "checkpoint_loader": None, "checkpoint_format": None, "kv_connector_config": None, "mm_encoder_only": False,
    "ray_worker_extension_cls": None, "ray_placement_config": None, "enable_sleep": False,
    "use_cute_dsl_blockscaling_mm": False, "use_cute_dsl_blockscaling_bmm": False,
    "disable_flashinfer_sampling": False, "max_stats_len": 1000, "layer_wise_benchmarks_config": None,
    "backend": "pytorch",
}


class TorchLlmArgs(StrictBaseModel):
    FIELDS = {**_BASE_LLM_ARGS, **_TORCH_LLM_ARGS}
    REQUIRED = ("model",)
    NESTED = {"kv_cache_config": KvCacheConfig, "scheduler_config": SchedulerConfig,
              "cuda_graph_config": CudaGraphConfig, "kv_connector_config": KvCacheConnectorConfig,
              "speculative_config": NGramDecodingConfig}

    def _validate(self, name: str, value: Any) -> Any:
        if name == "env_overrides" and value is not None:
            return {str(k): str(v) for k, v in value.items()}
        return value
