# SPDX-License-Identifier: Apache-2.0
"""Starts the real ``tritonserver`` on a model repository and stops it cleanly.

On a CPU machine the binary is the one shipped in PyPI ``nvidia-pytriton`` (Triton 2.51 with the
Python backend). Its backend directory is assembled in a scratch folder, never in site-packages:

    <scratch>/backends/python/  libtriton_python.so  triton_python_backend_utils.py
                                triton_python_backend_stub   (the one built for this Python)

The server runs with this interpreter's environment first on PATH, so the backend stub imports
the same packages (torch, trtllm_vtoken) as the caller. In the GPU image the NGC server is used
instead (``tritonserver`` on PATH, its own backends).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trtllm_vtoken.serving.settings import ServingSettings

MODEL = "tensorrt_llm"
_PARAM = re.compile(r'parameters:\s*\{\s*key:\s*"(?P<key>[^"]+)",\s*value:\s*\{\s*string_value:\s*"(?P<value>[^"]*)"\s*\}\s*\}')


def default_repository() -> Path:
    """``triton_model_repo`` of a source checkout (the Docker image copies it to /opt)."""
    for candidate in (Path(__file__).resolve().parents[2] / "triton_model_repo", Path("/opt/vtoken/triton_model_repo")):
        if (candidate / MODEL / "config.pbtxt").is_file():
            return candidate
    raise ValueError("no triton_model_repo found; pass --repository PATH")


def find_tritonserver() -> tuple[Path, Path | None]:
    """(server binary, pytriton's tritonserver folder or None for a system install)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.origin is not None:
        root = Path(spec.origin).parent / "tritonserver"
        if (root / "bin" / "tritonserver").is_file():
            return root / "bin" / "tritonserver", root
    system = shutil.which("tritonserver")
    if system:
        return Path(system), None
    raise ValueError("tritonserver not found: install PyPI 'nvidia-pytriton' (pip install --no-deps "
                     "nvidia-pytriton==0.7.0) or run inside the Triton container")


def prepare_backends(pytriton_root: Path, scratch: Path) -> Path:
    """Assembles a backend directory whose Python backend matches this interpreter."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = pytriton_root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ValueError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    python = scratch / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (pytriton_root / "backends" / "python" / "libtriton_python.so",
                   pytriton_root / "backends" / "python" / "triton_python_backend_utils.py", stub):
        shutil.copy2(source, python / source.name)
    return scratch / "backends"


def _stub_library_dirs() -> list[str]:
    """Libraries the backend stub must load: this interpreter's own libpython first (the stub
    embeds Python and must run the same build as the stdlib it imports, not whatever
    ``libpython3.x.so`` the system has), then the CUDA runtime bundled in nvidia-pytriton."""
    import sysconfig

    dirs = []
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        dirs.append(sysconfig.get_config_var("LIBDIR"))
    _, root = find_tritonserver()
    if root is not None:
        dirs += [str(p) for p in root.parent.parent.glob("nvidia_pytriton.libs")]
    return dirs


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on localhost right now (for servers in tests and benchmarks)."""
    import socket

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def repository_parameters(repository: Path) -> dict[str, str]:
    return {m["key"]: m["value"] for m in _PARAM.finditer((repository / MODEL / "config.pbtxt").read_text())}


def prepare_repository(source: Path, target: Path, overrides: dict[str, str]) -> Path:
    """Copies the repository, setting the model's parameters from ``overrides``. The resulting
    parameter set is validated here (ValueError), before any server starts."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / MODEL / "config.pbtxt"
    text = config.read_text()
    for key, value in overrides.items():
        line = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
        pattern = re.compile(r'parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'",[^\n]*\}\s*\}')
        text, found = pattern.subn(line.replace("\\", "\\\\"), text)
        if not found:
            text += line + "\n"
    config.write_text(text)
    ServingSettings.from_parameters(repository_parameters(target))
    return target


class TritonServer:
    """A ``tritonserver`` process. Use as a context manager, or ``start()`` / ``stop()``."""

    def __init__(self, repository: Path, scratch: Path, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, log_file: Path | None = None, verbose: bool = False) -> None:
        self.repository, self.scratch = Path(repository), Path(scratch)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_file = log_file or self.scratch / "tritonserver.log"
        self.verbose = verbose
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        binary, root = find_tritonserver()
        command = [str(binary), "--model-repository", str(self.repository),
                   "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                   "--metrics-port", str(self.metrics_port), "--allow-metrics", "true",
                   "--exit-timeout-secs", "30"]
        if root is not None:
            command += ["--backend-directory", str(prepare_backends(root, self.scratch))]
        if self.verbose:
            command += ["--log-verbose", "1"]
        return command

    def start(self, timeout_s: float = 180.0) -> TritonServer:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (*_stub_library_dirs(), env.get("LD_LIBRARY_PATH", "")) if p)
        self.scratch.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "wb")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT (Triton unloads models, finalize() runs), then SIGKILL if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
