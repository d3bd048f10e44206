# SPDX-License-Identifier: Apache-2.0
"""Double of the enums of ``tensorrt_llm.bindings`` the KV-cache manager takes: ``DataType``
(``KVCacheManager.__init__(..., dtype: DataType = DataType.HALF)``; ``KvCacheCreator`` passes the
model's dtype, BF16 for a bf16 model: ``str_dtype_to_binding(torch_dtype_to_str(model_engine.dtype))``
in ``_torch/pyexecutor/_util.py`` ``_create_kv_cache_manager``) and ``CacheType`` (SELF,
SELFKONLY: MLA). ``FP8``: ``kv_cache_config.dtype="fp8"``, a pool of float8_e4m3fn codes."""

import enum

import torch


class DataType(enum.Enum):
    FLOAT = torch.float32
    HALF = torch.float16
    BF16 = torch.bfloat16
    FP8 = torch.float8_e4m3fn


class CacheType(enum.Enum):
    SELF = 0
    CROSS = 1
    SELFKONLY = 2
