# SPDX-License-Identifier: Apache-2.0
"""Starts the real ``tritonserver`` on a model repository and stops it cleanly.

On a CPU machine the binary is the one shipped in PyPI ``nvidia-pytriton`` (Triton 2.51 with the
Python backend). Its backend directory is assembled in a scratch folder, never in site-packages:

    <scratch>/backends/python/  libtriton_python.so  triton_python_backend_utils.py
                                triton_python_backend_stub   (the one built for this Python)

The server runs with this interpreter's environment first on PATH, so the backend stub imports
the same packages (torch, trtllm_vtoken) as the caller. In the GPU image the NGC server is used
instead (``tritonserver`` on PATH, its own backends).

Stopping. Triton's own Ctrl-C path first waits, up to its exit timeout, for every HTTP connection
to close, an idle keep-alive one included; the time left (none, with such a client) then goes to
unloading the models, which Triton does only once their requests have ended. So ``stop()`` unloads
the models itself first, through the model-repository API (model control "explicit", that API
restricted to callers that hold this server's ``admin_key``): the models' ``finalize`` runs, and
the ``tensorrt_llm`` model fails its running requests as soon as the unload begins. Then SIGINT,
with a short exit timeout that only bounds the wait for idle connections. One more wait has no
bound in Triton 2.51: its gRPC front end waits, after everything else has stopped, for the
clients' open streams to close (fixed upstream by triton-inference-server/server#7969). With the
models unloaded nothing is left to lose, so a server still there ``GRPC_GRACE_S`` later is
killed, and ``stop_note`` says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trtllm_vtoken.serving.settings import ServingSettings
from trtllm_vtoken.serving.triton_log import copy_log, cpu_only_options, has_cuda_driver

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


ADMIN_HEADER = "vtoken-admin-key"
GRPC_GRACE_S = 2.0


class TritonServer:
    """A ``tritonserver`` process. Use as a context manager, or ``start()`` / ``stop()``.

    Args:
        host: The address Triton binds its HTTP, gRPC and metrics endpoints to (0.0.0.0: every
            interface, as Triton's default; 127.0.0.1: this machine only).
        exit_timeout_s: Triton's ``--exit-timeout-secs``; after ``stop()`` has unloaded the models
            it only bounds the wait for clients' idle connections to close.
        env: Extra environment variables for the server and its backend stubs.
    """

    def __init__(self, repository: Path, scratch: Path, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, log_file: Path | None = None, verbose: bool = False,
                 host: str = "0.0.0.0", exit_timeout_s: int = 1, env: dict[str, str] | None = None) -> None:
        self.repository, self.scratch = Path(repository), Path(scratch)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_file = log_file or self.scratch / "tritonserver.log"
        self.verbose = verbose
        self.host, self.exit_timeout_s, self.extra_env = host, exit_timeout_s, dict(env or {})
        self.admin_key = secrets.token_hex(16)
        self.cpu_only = not has_cuda_driver()
        self.process: subprocess.Popen | None = None
        self.stop_problem: str | None = None
        """After ``stop()``: None, or one line saying what did not go cleanly."""
        self.stop_note: str | None = None
        """After ``stop()``: a line about a harmless detour (see the module doc), or None."""

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches the server."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.client_host}:{self.metrics_port}"

    def command(self) -> list[str]:
        binary, root = find_tritonserver()
        restricted = f"model-repository:{ADMIN_HEADER}={self.admin_key}"
        command = [str(binary), "--model-repository", str(self.repository),
                   "--http-address", self.host, "--http-port", str(self.http_port),
                   "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
                   "--metrics-address", self.host, "--metrics-port", str(self.metrics_port),
                   "--allow-metrics", "true", "--exit-timeout-secs", str(self.exit_timeout_s),
                   "--model-control-mode", "explicit", "--load-model", "*",
                   "--http-restricted-api", restricted, "--grpc-restricted-protocol", restricted]
        if self.cpu_only:
            command += cpu_only_options()
        if root is not None:
            command += ["--backend-directory", str(prepare_backends(root, self.scratch))]
        if self.verbose:
            command += ["--log-verbose", "1"]
        return command

    def start(self, timeout_s: float = 180.0) -> TritonServer:
        env = {**os.environ, **self.extra_env}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (*_stub_library_dirs(), env.get("LD_LIBRARY_PATH", "")) if p)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self._log_copier = copy_log(self.process.stdout, self.log_file, self.cpu_only)
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
        """Unloads the models (``finalize`` runs; requests still running are failed), then SIGINT,
        then SIGKILL if the server hangs. Returns its exit code; what went wrong, if anything, is
        in ``stop_problem``."""
        if self.process is None:
            return None
        if self.process.poll() is not None:  # it exited by itself (say, a port taken after the models loaded)
            self._kill_leftovers()
            return self.process.returncode
        self.stop_problem = self.stop_note = None
        try:
            self.unload_models(timeout_s)
            unloaded = True
        except (OSError, RuntimeError, ValueError) as error:
            self.stop_problem = f"unloading the models failed: {error}"
            unloaded = False
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(self.exit_timeout_s + GRPC_GRACE_S if unloaded else timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
            if unloaded:
                self.stop_note = ("models unloaded; tritonserver then hung closing a client's open gRPC stream "
                                  "(Triton 2.51) and was killed")
            else:
                self.stop_problem = f"tritonserver did not exit within {timeout_s:.0f} s and was killed"
        self._kill_leftovers()
        self._log_copier.join(5)
        if code != 0 and self.stop_problem is None and self.stop_note is None:
            self.stop_problem = f"tritonserver exited with {code}: {self.last_error() or 'see its log'}"
        return code

    def _kill_leftovers(self) -> None:
        """Ends what the server started and left behind: backend stubs outlive a tritonserver
        that exits without unloading its models. They stay in its session's process group."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def unload_models(self, timeout_s: float) -> None:
        """Asks Triton to unload every model and waits until none is left loaded."""
        for model in self._repository_call("index"):
            if model.get("state") == "READY":
                self._repository_call(f"models/{model['name']}/unload")
        deadline = time.monotonic() + timeout_s
        while True:
            loaded = [m["name"] for m in self._repository_call("index") if m.get("state") in ("READY", "UNLOADING")]
            if not loaded:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"still loaded after {timeout_s:.0f} s: {', '.join(loaded)}")
            time.sleep(0.1)

    def _repository_call(self, path: str):
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/{path}", data=b"{}",
                                         headers={ADMIN_HEADER: self.admin_key})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def last_error(self) -> str | None:
        """The last error line of the log (E... lines), without Triton's prefix."""
        errors = [line for line in self.log_tail(200).splitlines() if line.startswith("E")]
        return errors[-1].split("] ", 1)[-1].strip('"') if errors else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
