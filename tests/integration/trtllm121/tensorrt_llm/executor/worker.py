# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/executor/worker.py`` ``worker_main`` and of ``base_worker.py``
``BaseWorker.setup_engine`` (1.2-era copies, index ids 3662896411, 1131391427):

- ``worker_main`` applies ``llm_args.env_overrides`` with ``os.environ.update`` before anything
  else (the real comment: MPI caches the client's environment at ``import tensorrt_llm``, so
  overrides set later reach the worker only this way). Every stored copy with this ``worker_main``
  has that update (also index ids 65785603142, 66326986617), but no copy tied to a release tag
  was found, and ``env_overrides`` first arrived as a client-side update in ``llm.py`` (PR #9104).
  A worker of a build with the field but without the update is modelled too: with
  ``TLLM_DOUBLE_WORKER_APPLIES_ENV_OVERRIDES=0`` in the worker's environment it skips the update;
- ``setup_engine`` imports ``create_py_executor`` inside the function
  (``from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor``), i.e.
  reads the module attribute at call time, and calls it with ``llm_args``, ``checkpoint_dir``,
  ``tokenizer``.
The return value (``describe``) is the test's view of the executor the worker built."""

from __future__ import annotations

import importlib
import os


def describe(executor) -> dict:
    manager = executor.resources["kv_cache_manager"]
    modules = [m for m in executor.model_engine.model.modules() if hasattr(m, "rope_fusion")]
    vtoken = getattr(manager, "vtoken", None)
    return {
        "pid": os.getpid(),
        "manager": type(manager).__qualname__,
        "rope_fusion": [m.rope_fusion for m in modules],
        "policy": vtoken.settings.policy if vtoken is not None else None,
        "budget": vtoken.settings.budget if vtoken is not None else None,
        "pool_dtype": str(manager.get_buffers(manager.pp_layers[0]).dtype),
        "environ": {k: v for k, v in os.environ.items() if k.startswith("VTOKEN_")},
    }


class GenerationExecutorWorker:
    def __init__(self, llm_args) -> None:
        self.llm_args = llm_args
        self.engine = self.setup_engine()

    def setup_engine(self):
        package = __name__.rsplit(".", 2)[0]
        creator = importlib.import_module(f"{package}._torch.pyexecutor.py_executor_creator")
        create_executor = creator.create_py_executor  # the function-local import of the real code
        return create_executor(llm_args=self.llm_args, checkpoint_dir=None, tokenizer=None)


def worker_main(llm_args=None) -> dict:
    applies = os.environ.get("TLLM_DOUBLE_WORKER_APPLIES_ENV_OVERRIDES", "1") == "1"
    overrides = getattr(llm_args, "env_overrides", None)  # an older TorchLlmArgs has no such field
    if applies and overrides:
        os.environ.update(overrides)
    return describe(GenerationExecutorWorker(llm_args).engine)
