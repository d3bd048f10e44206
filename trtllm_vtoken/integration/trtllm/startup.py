# SPDX-License-Identifier: Apache-2.0
"""The start-up hook that installs vToken inside TensorRT-LLM's executor worker, and proves in the
client that it did (TensorRT-LLM 1.2).

The package ships ``trtllm_vtoken_startup.pth`` at the root of site-packages; Python's ``site``
runs its one line, ``import trtllm_vtoken.integration.trtllm.startup``, in every interpreter of
that environment, the executor worker TensorRT-LLM spawns with MPI included (``mpi4py.futures``
starts ``sys.executable -m mpi4py.futures.server``, an ordinary interpreter start). Importing this
module only registers an import hook for two modules; it imports neither torch nor TensorRT-LLM,
so interpreters that never build a TensorRT-LLM executor are unaffected.

How vToken's two variables reach the worker ($VTOKEN_TRTLLM arms it: "1" vToken, "rope" unfused
RoPE only, unset or "0" off; $VTOKEN_TRTLLM_SETTINGS carries the ``VTokenSettings`` as JSON):

    exported before ``import tensorrt_llm``   MPI initialises at that import and spawns workers
        (every version)                        with the environment it saw then (1.2-era
                                               ``mpi_session.py`` passes no ``env``); variables
                                               set later never reach a worker this way
    ``env_overrides`` (an LLM argument,        the client sets them in its own environment
        TorchLlmArgs 1.2; not in 1.1)          (``BaseLLM._process_env_overrides``); the worker
                                               applies them only where ``worker_main`` runs
                                               ``os.environ.update(llm_args.env_overrides)``
                                               (every stored 1.2-era ``worker.py``; not tied to
                                               a release tag), and 2026 ``main`` also hands them
                                               to ``MPIPoolExecutor(env=...)``

``vtoken_llm_args`` uses both: it exports the variables in this process (they reach workers of an
MPI initialised after the call) and adds ``env_overrides`` where ``TorchLlmArgs`` has the field.
Which one arrived is decided in the worker, so the client checks: every ``LLM`` built while armed
is verified after its executor is up (``arming.py``), and a worker that did not arm is an error.

In the worker, the decision waits until the executor is created (after ``worker_main`` applied
the overrides):

    worker start        site -> .pth -> hooks registered (environment: the MPI-init snapshot)
    worker_main         os.environ.update(llm_args.env_overrides)        <- $VTOKEN_TRTLLM* arrive
    setup_engine        from ...py_executor_creator import create_py_executor   (function-local,
                        so the module attribute is read at call time: the wrapped function)
    create_py_executor  armed? -> settings checked, patches installed, then the original:
                          PyTorchModelEngine(...)   every Attention.__init__ reads support_fused_rope()
                          KvCacheCreator            get_kv_cache_manager_cls -> VTokenKVCacheManager,
                                                    which writes the worker's record (arming.py)

In the client, ``BaseLLM.__init__`` (``llmapi/llm.py``: its ``_build_model`` creates the executor,
and for the PyTorch backend waits until the worker reports it ready) is wrapped: armed for this
LLM (its ``env_overrides``, or the environment ``import tensorrt_llm`` saw), it reads the worker's
record from the settings' stats file once the original returns, and raises if there is none.
Armed without settings is an error in the worker, never a default.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
from collections.abc import Callable

from trtllm_vtoken.integration.trtllm.environment import ARM_VAR, SETTINGS_VAR, armed

CREATOR_MODULE = "tensorrt_llm._torch.pyexecutor.py_executor_creator"
"""Where TensorRT-LLM's worker finds ``create_py_executor`` (the same path from 1.0 to 2026 main)."""
LLM_MODULE = "tensorrt_llm.llmapi.llm"
"""Where ``BaseLLM`` lives (1.0 to 2026 main); ``tensorrt_llm/__init__.py`` imports it."""

import_environ: dict[str, str] = {}
"""vToken's variables as this process's environment held them when ``LLM_MODULE`` was imported,
i.e. during ``import tensorrt_llm``, when MPI initialised: what a spawned worker inherits."""


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


def wrap_llm_init(init):
    """``BaseLLM.__init__`` that verifies, when this LLM is armed, that its worker armed (idempotent)."""
    if getattr(init, "vtoken_wrapped", False):
        return init

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        overrides = kwargs.get("env_overrides")
        if not armed(overrides or {}) and not armed(import_environ):
            return init(self, *args, **kwargs)
        from trtllm_vtoken.integration.trtllm.arming import verified_construction

        return verified_construction(init, self, args, kwargs, import_environ)

    __init__.vtoken_wrapped = True
    return __init__


def _wrap_creator_module(module) -> None:
    if hasattr(module, "create_py_executor"):
        module.create_py_executor = wrap_creator(module.create_py_executor)


def _wrap_llm_module(module) -> None:
    import_environ.clear()
    import_environ.update({k: os.environ[k] for k in (ARM_VAR, SETTINGS_VAR) if k in os.environ})
    base = getattr(module, "BaseLLM", None) or getattr(module, "LLM", None)
    if base is not None:
        base.__init__ = wrap_llm_init(base.__init__)


WRAPS: dict[str, Callable] = {CREATOR_MODULE: _wrap_creator_module, LLM_MODULE: _wrap_llm_module}


class _WrappingLoader(importlib.abc.Loader):
    """TensorRT-LLM's own loader for a hooked module, plus the wrap once it has executed."""

    def __init__(self, inner, wrap: Callable) -> None:
        self.inner, self.wrap = inner, wrap

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.wrap(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... as the inner loader
        return getattr(self.inner, name)


class StartupHook(importlib.abc.MetaPathFinder):
    """Finds the modules of ``WRAPS`` with the finders after it and wraps their loaders; ignores
    the rest."""

    def find_spec(self, fullname, path, target=None):
        wrap = WRAPS.get(fullname)
        if wrap is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappingLoader(spec.loader, wrap)
                return spec
        return None


def register() -> None:
    """Puts the hook first on ``sys.meta_path`` once; wraps the modules already loaded."""
    if not any(isinstance(finder, StartupHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, StartupHook())
    for name, wrap in WRAPS.items():
        if name in sys.modules:
            wrap(sys.modules[name])


register()
