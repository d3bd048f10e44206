# SPDX-License-Identifier: Apache-2.0
"""Model parameters of the Triton model (config.pbtxt ``parameters``), typed and validated.

Triton passes every parameter as a string. Keys are the ``EngineConfig`` fields plus the serving
ones below; an unknown key is an error, so a typo in a repository never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtllm_vtoken.runtime.config import EngineConfig


@dataclass(frozen=True)
class ServingSettings:
    engine: EngineConfig
    model: str = "smollm2-135m-instruct"
    """A Hugging Face Llama folder, or the embedded default's name."""
    chat_template: bool = True
    """Wrap ``text_input`` as one user turn of the model's chat template."""
    max_tokens_limit: int = 1024
    default_max_tokens: int = 64
    threads: int = 0
    """Intra-op CPU threads of the reference engine's process; 0: the cores the process may use but
    one (``trtllm_vtoken/threads.py``)."""
    backend: str = "auto"
    """"reference": vToken's torch engine. "trtllm": TensorRT-LLM's LLM API with vToken installed
    (needs tensorrt_llm and a GPU). "auto": trtllm where both are present (and the engine is not
    ``batch_invariant``, which is the reference engine's), else reference."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "reference", "trtllm"):
            raise ValueError(f"backend must be auto, reference or trtllm, got {self.backend!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: chosen from the cores), got {self.threads}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(f"default_max_tokens must lie in [1, max_tokens_limit={self.max_tokens_limit}]")

    def check_host(self) -> None:
        """ValueError, before any server starts, where this machine cannot serve these settings:
        a model that is neither the embedded default nor a folder with config.json, the trtllm
        backend without TensorRT-LLM and a GPU, a CUDA device without one."""
        import torch

        from trtllm_vtoken.runtime.checkpoint import DEFAULT_MODEL
        from trtllm_vtoken.serving.trtllm_loop import trtllm_available

        if self.model != DEFAULT_MODEL and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model {self.model!r} is not a model folder (no config.json); use "
                             f"{DEFAULT_MODEL!r} or a Hugging Face folder")
        if self.backend == "trtllm" and not trtllm_available():
            raise ValueError("backend 'trtllm' needs tensorrt_llm importable and a CUDA device; "
                             "use backend 'reference' or 'auto'")
        if str(self.engine.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.engine.device!r}: torch sees no CUDA device here")

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> ServingSettings:
        """From config.pbtxt parameters (strings). Raises ValueError for unknown keys or values."""
        engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
        own_fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "engine"}
        engine_values, own_values = {}, {}
        for key, raw in parameters.items():
            if key in own_fields:
                own_values[key] = _convert(key, raw, typing.get_type_hints(cls)[key])
            elif key in engine_fields:
                engine_values[key] = _convert(key, raw, typing.get_type_hints(EngineConfig)[key])
            else:
                known = sorted({*engine_fields, *own_fields})
                raise ValueError(f"unknown model parameter {key!r}; known: {known}")
        return cls(engine=EngineConfig(**engine_values), **own_values)


def _convert(key: str, raw: str, hint: Any) -> Any:
    raw = raw.strip()
    options = set(typing.get_args(hint))
    if type(None) in options and raw.lower() in ("", "none"):  # an optional field left unset
        return None
    if options and int in options and not options - {int, type(None)}:
        hint = int  # int | None
    if typing.get_origin(hint) is dict or dict in options or any(dataclasses.is_dataclass(o) for o in options):
        # a JSON object: policy_options, speculative_config
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"model parameter {key!r} must be a JSON object, got {raw!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"model parameter {key!r} must be a JSON object, got {raw!r}")
        return value
    if hint is bool:
        if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"model parameter {key!r} must be true or false, got {raw!r}")
        return raw.lower() in ("true", "1", "yes")
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"model parameter {key!r} must be an integer, got {raw!r}") from None
    return raw  # strings, literals and budgets (int | float | str) are validated by the config
