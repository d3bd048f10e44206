# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm.llmapi``."""

from .llm_args import (  # noqa: F401
    CapacitySchedulerPolicy,
    CudaGraphConfig,
    KvCacheConfig,
    KvCacheConnectorConfig,
    NGramDecodingConfig,
    SchedulerConfig,
    TorchLlmArgs,
)
