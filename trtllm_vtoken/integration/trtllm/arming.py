# SPDX-License-Identifier: Apache-2.0
"""Proof that vToken armed inside TensorRT-LLM's executor worker, checked by the client.

Whether vToken's settings reach the worker depends on the TensorRT-LLM build (``startup.py`` draws
the routes); a worker they miss builds TensorRT-LLM's own KV-cache manager and the run looks
normal. So the worker leaves a record and the client reads it:

    worker  VTokenKVCacheManager.__init__ / every snapshot     stats file: {"vtoken_worker": {
            (RoPE-only baseline: after the model is built)        "mode", "manager", "tensorrt_llm",
                                                                  "pid", "settings", "steps",
                                                                  "requests_seen", ...}, counters}
    client  BaseLLM.__init__ (wrapped by startup.py) while armed:
              before: the stats file's old record removed (a settings without a stats file get a
                      fresh one, through the same env_overrides)
              after:  the executor is up (``_build_model`` waited for the worker) -> the record
                      must be there, with the mode and settings this LLM sent; else the LLM is
                      shut down and RuntimeError names the cause and the fix

The record is a JSON object under ``RECORD_KEY`` beside the numeric counters, which ``read_stats``
keeps to themselves.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.integration.trtllm.environment import ARM_VAR, SETTINGS_VAR, arm_mode

RECORD_KEY = "vtoken_worker"


def tensorrt_llm_version(module: str = "tensorrt_llm") -> str:
    """``__version__`` of the TensorRT-LLM package that holds ``module`` (a class's module path)."""
    package = importlib.import_module(module.split("._torch")[0])
    return str(getattr(package, "__version__", "?"))


def worker_record(mode: str, settings: VTokenSettings, extends: str = "tensorrt_llm", **fields: Any) -> dict[str, Any]:
    """What a worker says about itself: ``mode`` ("vtoken" or "rope"), the settings it read, its
    pid, the version of the TensorRT-LLM whose module ``extends`` it patched, and ``fields``
    (manager class, steps run, requests seen...)."""
    return {"mode": mode, "pid": os.getpid(), "tensorrt_llm": tensorrt_llm_version(extends),
            "settings": asdict(settings), **fields}


def write_record(path: str | Path, record: Mapping[str, Any]) -> None:
    """Puts ``record`` into the stats file at ``path``, keeping its counters (atomic replace)."""
    path = Path(path)
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        values = {}
    values = values if isinstance(values, dict) else {}
    values[RECORD_KEY] = dict(record)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(values, sort_keys=True))
    os.replace(partial, path)


def read_record(path: str | Path) -> dict[str, Any] | None:
    """The worker's record in the stats file at ``path``, or None if there is none (yet)."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    record = values.get(RECORD_KEY) if isinstance(values, dict) else None
    return record if isinstance(record, dict) else None


def _expectation(kwargs: dict[str, Any], import_environ: Mapping[str, str]):
    """(mode, settings, where the settings came from) for an LLM built with ``kwargs``; None when
    it is not armed. An ``env_overrides`` that names $VTOKEN_TRTLLM decides; else the environment
    MPI captured at ``import tensorrt_llm``. A settings without a stats file gets a fresh one
    through ``env_overrides`` (in ``kwargs``) where the settings came from there."""
    overrides = dict(kwargs.get("env_overrides") or {})
    source, route = (overrides, "env_overrides") if ARM_VAR in overrides else (import_environ, "environment")
    mode = arm_mode(source)
    if mode is None:
        return None
    raw = overrides.get(SETTINGS_VAR) or import_environ.get(SETTINGS_VAR)
    settings = VTokenSettings.from_env({SETTINGS_VAR: raw} if raw else {ARM_VAR: "1"})
    if not settings.stats_file and SETTINGS_VAR in overrides:
        settings = settings.with_stats_file()
        kwargs["env_overrides"] = {**overrides, SETTINGS_VAR: settings.to_env()}
    return mode, settings, route


def verified_construction(init: Callable, llm: Any, args: tuple, kwargs: dict[str, Any],
                          import_environ: Mapping[str, str]) -> None:
    """Runs TensorRT-LLM's ``BaseLLM.__init__`` for an armed LLM, then checks the worker's record.
    RuntimeError (after shutting the LLM down) when the worker did not arm as this LLM asked."""
    expected = _expectation(kwargs, import_environ)
    if expected is None:
        return init(llm, *args, **kwargs)
    mode, settings, route = expected
    if not settings.stats_file:
        warnings.warn(f"vToken is armed through the {route} without a stats_file: whether TensorRT-LLM's "
                      "executor worker armed cannot be checked (give VTokenSettings a stats_file)", RuntimeWarning,
                      stacklevel=3)
        return init(llm, *args, **kwargs)
    Path(settings.stats_file).unlink(missing_ok=True)  # a record left by an earlier LLM proves nothing
    init(llm, *args, **kwargs)
    record = read_record(settings.stats_file)
    problem = worker_problem(record, mode, settings)
    if problem is None:
        return None
    shutdown = getattr(llm, "shutdown", None)
    if callable(shutdown):
        shutdown()
    raise RuntimeError(f"vToken was armed for this LLM ({ARM_VAR}={'1' if mode == 'vtoken' else mode} through "
                       f"the {route}) but {problem}. {fix_for(route)}")


def worker_problem(record: Mapping[str, Any] | None, mode: str, settings: VTokenSettings) -> str | None:
    """Why the worker's record does not show the arming asked for, or None if it does."""
    if record is None:
        return (f"TensorRT-LLM's executor worker left no record in {settings.stats_file}: it did not arm, and "
                "runs TensorRT-LLM's own KV-cache manager with fused RoPE")
    if record.get("mode") != mode:
        return f"the worker armed as {record.get('mode')!r}, not {mode!r}"
    if record.get("settings") != asdict(settings):
        return f"the worker armed with other settings ({record.get('settings')}) than this LLM sent"
    return None


def fix_for(route: str) -> str:
    if route == "env_overrides":
        return ("This TensorRT-LLM's worker does not apply env_overrides (its worker_main lacks the "
                "os.environ.update). Fix: call vtoken_llm_args(...) before `import tensorrt_llm`, or export "
                f"{ARM_VAR} and {SETTINGS_VAR} before Python starts, so that the environment MPI gives the "
                "worker carries them; and check that trtllm_vtoken_startup.pth is in the worker's site-packages")
    return ("The worker got the variables from the environment but did not arm: is trtllm_vtoken_startup.pth in "
            "the site-packages of the worker's interpreter (pip install the package there)?")
