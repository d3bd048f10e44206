# SPDX-License-Identifier: Apache-2.0
"""``vtoken serve``'s errors: one line each, found before tritonserver starts where they can be,
and no scratch folder left behind but the one holding a failed server's log."""

from __future__ import annotations

import socket
import subprocess
import tempfile

import pytest

from trtllm_vtoken.cli import main
from trtllm_vtoken.serving.triton import free_ports


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    """Where ``tempfile.mkdtemp`` puts serve's scratch folder, for the test to look at."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent"], "model '/nonexistent' is not a model folder (no config.json)"),
    (["--backend", "trtllm"], "backend 'trtllm' needs tensorrt_llm importable and a CUDA device"),
    (["--device", "cuda"], "device 'cuda': torch sees no CUDA device here"),
    (["--repository", "/nonexistent"], "/nonexistent is not a model repository (no tensorrt_llm/config.pbtxt)"),
    (["--budget", "1.5"], "retention ratio must lie in (0, 1], got 1.5"),
    (["--batch-invariant", "--device", "cuda"], "batch_invariant runs on the CPU (device 'cuda')"),
])
def test_what_this_machine_cannot_serve_is_one_line_before_any_server(argv, message, scratch_root, capsys):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vtoken: error: {message}") and len(err.splitlines()) == 1
    assert not list(scratch_root.iterdir())  # the scratch folder went with the error


def test_a_server_that_does_not_start_is_one_line_naming_its_log(scratch_root, capsys):
    """The HTTP port is taken: tritonserver exits; the error quotes its log's reason and keeps the log."""
    http, grpc, metrics = free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", http))
        taken.listen()
        assert main(["serve", "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
                     "--metrics-port", str(metrics)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("vtoken serve: starting tritonserver (log: ") and len(lines) == 2
    assert lines[1].startswith("vtoken: error: tritonserver did not start: ") and "already in use" in lines[1]
    (kept,) = scratch_root.iterdir()
    assert f"(log: {kept / 'tritonserver.log'})" in lines[1] and (kept / "tritonserver.log").is_file()
    # the model's backend stub, started before the port failed, did not outlive the server
    left = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub {kept}"], capture_output=True, text=True)
    assert not left.stdout.strip(), left.stdout
