# SPDX-License-Identifier: Apache-2.0
"""Every name the sources use is defined (pyflakes' undefined-name checks). Code that only a GPU or
a TensorRT-LLM installation runs is read too: no test here executes it, and a name left over from an
edit there (``TorchCopyExecutor.submit_slots`` kept a removed ``indices`` in its CUDA branch, so every
CUDA copy raised NameError) shows only on the machine that runs it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trtllm_vtoken

pyflakes = pytest.importorskip("pyflakes.checker")
messages = pytest.importorskip("pyflakes.messages")

ROOT = Path(trtllm_vtoken.__file__).parent.parent
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


def test_no_source_uses_an_undefined_name():
    found = []
    for folder in ("trtllm_vtoken", "tests", "scripts", "examples", "triton_model_repo"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            checker = pyflakes.Checker(ast.parse(source, str(path)), filename=str(path))
            found += [f"{path.relative_to(ROOT)}:{m.lineno}: {m.message % m.message_args}"
                      for m in checker.messages if isinstance(m, UNDEFINED)]
    assert not found, "\n".join(found)
