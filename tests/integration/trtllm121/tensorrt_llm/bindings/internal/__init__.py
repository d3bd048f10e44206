# SPDX-License-Identifier: Apache-2.0
"""Doubles of ``tensorrt_llm.bindings.internal``: the C++ KV-cache manager behind
``KVCacheManager.impl`` (``batch_manager``) and the capacity scheduler over it (``algorithms``)."""
