# SPDX-License-Identifier: Apache-2.0
"""The module named in ``connector_config``: TensorRT-LLM imports it inside the executor worker
before it builds the KV-cache manager, which is what makes the patches reach the worker (they
would not if applied in the client process). The connector classes themselves move no data."""

from __future__ import annotations

import importlib

from trtllm_vtoken.integration.trtllm.patches import install

INSTALLED = install()


def _bases():
    for name in ("tensorrt_llm._torch.pyexecutor.kv_cache_connector",
                 "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"):
        try:
            module = importlib.import_module(name)
            return module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker
        except (ImportError, AttributeError):
            continue
    raise RuntimeError("TensorRT-LLM has no KV-cache connector module: vToken targets 1.2.1")


_SchedulerBase, _WorkerBase = _bases()


class VTokenConnectorScheduler(_SchedulerBase):
    """Matches nothing and loads nothing: vToken only needs the import."""

    def build_connector_meta(self, *args, **kwargs):
        return None

    def get_num_new_matched_tokens(self, *args, **kwargs):
        return 0, False

    def update_state_after_alloc(self, *args, **kwargs) -> None:
        return None

    def request_finished(self, *args, **kwargs) -> bool:
        return False


class VTokenConnectorWorker(_WorkerBase):
    def register_kv_caches(self, *args, **kwargs) -> None:
        return None

    def start_load_kv(self, *args, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, *args, **kwargs) -> None:
        return None

    def save_kv_layer(self, *args, **kwargs) -> None:
        return None

    def wait_for_save(self, *args, **kwargs) -> None:
        return None

    def get_finished(self, *args, **kwargs):
        return [], []
