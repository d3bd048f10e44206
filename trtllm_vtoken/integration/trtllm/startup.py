# SPDX-License-Identifier: Apache-2.0
"""The start-up hook that installs vToken inside TensorRT-LLM's executor worker (1.2.1).

The package ships ``trtllm_vtoken_startup.pth`` at the root of site-packages; Python's ``site``
runs its one line, ``import trtllm_vtoken.integration.trtllm.startup``, in every interpreter of
that environment, the executor worker TensorRT-LLM spawns with MPI included (``mpi4py.futures``
starts ``sys.executable -m mpi4py.futures.server``, an ordinary interpreter start). Importing this
module only registers an import hook for one module; it imports neither torch nor TensorRT-LLM,
so interpreters that never build a TensorRT-LLM executor are unaffected.

Why the decision waits until the executor is created: vToken's settings reach the worker as
``env_overrides`` (an LLM argument), which ``executor/worker.py`` ``worker_main`` applies with
``os.environ.update`` after the interpreter has started (MPI caches the client's environment at
``import tensorrt_llm``; variables set later do not reach the spawned worker otherwise):

    worker start        site -> .pth -> this hook registered (environment: the MPI-init snapshot)
    worker_main         os.environ.update(llm_args.env_overrides)        <- $VTOKEN_TRTLLM* arrive
    setup_engine        from ...py_executor_creator import create_py_executor   (function-local,
                        so the module attribute is read at call time: the wrapped function)
    create_py_executor  $VTOKEN_TRTLLM=1? -> settings checked, patches installed, then the original:
                          PyTorchModelEngine(...)   every Attention.__init__ reads support_fused_rope()
                          KvCacheCreator            get_kv_cache_manager_cls -> VTokenKVCacheManager

$VTOKEN_TRTLLM arms vToken ("1"; unset or "0": off); $VTOKEN_TRTLLM_SETTINGS carries the
``VTokenSettings`` as JSON. Armed without settings is an error in the worker, never a default.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from collections.abc import Mapping

ARM_VAR = "VTOKEN_TRTLLM"
SETTINGS_VAR = "VTOKEN_TRTLLM_SETTINGS"
CREATOR_MODULE = "tensorrt_llm._torch.pyexecutor.py_executor_creator"
"""Where TensorRT-LLM's worker finds ``create_py_executor`` (the same path from 1.0 to 2026 main)."""


def armed(environ: Mapping[str, str] | None = None) -> bool:
    """Is vToken armed in this process? ValueError for a value other than "1", "0" or empty."""
    value = (os.environ if environ is None else environ).get(ARM_VAR, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${ARM_VAR} must be 1 (vToken on) or 0 / unset (off), got {value!r}")
    return value == "1"


def wrap_creator(create):
    """``create_py_executor`` that installs vToken first when armed (idempotent)."""
    if getattr(create, "vtoken_wrapped", False):
        return create

    @functools.wraps(create)
    def create_py_executor(*args, **kwargs):
        if armed():
            from trtllm_vtoken.integration.trtllm.patches import activate

            activate(kwargs.get("llm_args", args[0] if args else None))
        return create(*args, **kwargs)

    create_py_executor.vtoken_wrapped = True
    return create_py_executor


def _wrap_module(module) -> None:
    if hasattr(module, "create_py_executor"):
        module.create_py_executor = wrap_creator(module.create_py_executor)


class _CreatorLoader(importlib.abc.Loader):
    """TensorRT-LLM's own loader for the creator module, plus the wrap once it has executed."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _wrap_module(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... as the inner loader
        return getattr(self.inner, name)


class CreatorHook(importlib.abc.MetaPathFinder):
    """Finds ``CREATOR_MODULE`` with the finders after it and wraps its loader; ignores the rest."""

    def find_spec(self, fullname, path, target=None):
        if fullname != CREATOR_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CreatorLoader(spec.loader)
                return spec
        return None


def register() -> None:
    """Puts the hook first on ``sys.meta_path`` once; wraps the module if it is already loaded."""
    if not any(isinstance(finder, CreatorHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, CreatorHook())
    if CREATOR_MODULE in sys.modules:
        _wrap_module(sys.modules[CREATOR_MODULE])


register()
