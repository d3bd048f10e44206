# SPDX-License-Identifier: Apache-2.0
"""A double of the ``tensorrt_llm`` package (1.2.1) for CPU tests: ``tensorrt_llm/`` below, with
the real module paths and class names. It models what vToken relies on and what reality is
strict about: argument validation, the executor's construction order, the worker process and
the environment it gets, RoPE fusion, the KV pool and its allocator. Each module's docstring
cites the real file and function per behaviour (index ids are of the search index's stored
copies; "1.2-era" copies carry ``env_overrides``, ``layer_wise_benchmarks_config`` and
``use_kv_cache_manager_v2`` defaulting to False).

Put this folder on ``sys.path`` (``PYTHONPATH``) to import the double as ``tensorrt_llm``; inside,
imports are relative, so ``tests.integration.trtllm121.tensorrt_llm`` works as well."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
