# SPDX-License-Identifier: Apache-2.0
"""Every Python block of README.md runs as written: in order, in one namespace, as a reader would
paste them into one session. Blocks that import tensorrt_llm run only where it imports."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def needs_trtllm(block: str) -> bool:
    return re.search(r"^\s*(from|import) tensorrt_llm\b", block, flags=re.M) is not None


def test_the_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 4 and all(block.strip() for block in blocks)


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(smollm2_folder):
    """The real model loads as the README's ``LLM(...)`` loads it (the fixture converts it once)."""
    namespace: dict = {"__name__": "__readme__"}
    ran = 0
    for number, block in enumerate(python_blocks(), 1):
        if needs_trtllm(block):
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block, f"README.md python block {number}", "exec"), namespace)
            except Exception as exc:  # the block's number in the failure, then the error itself
                raise AssertionError(f"README python block {number} failed: {exc!r}") from exc
        ran += 1
    assert ran >= 3


@pytest.mark.trtllm
def test_readme_tensorrt_llm_blocks_run_as_written():
    blocks = [b for b in python_blocks() if needs_trtllm(b)]
    assert blocks and importlib.util.find_spec("tensorrt_llm") is not None
    for block in blocks:
        exec(compile(block, "README.md (TensorRT-LLM)", "exec"), {"__name__": "__readme__"})
