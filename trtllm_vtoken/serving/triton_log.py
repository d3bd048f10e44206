# SPDX-License-Identifier: Apache-2.0
"""tritonserver's output, copied to its log file, without the GPU complaints of a CPU machine.

nvidia-pytriton's ``tritonserver`` is a GPU build. Without a CUDA driver it reports, although all
is well: NVML/DCGM failures (GPU metrics), the pinned-memory pool it cannot allocate, and its
CUDA block manager that cannot start. The launcher turns off what has an option
(``--allow-gpu-metrics false``, ``--pinned-memory-pool-byte-size 0``, see ``cpu_only_options``);
what has none is dropped here, and the log says once, in one line, that the server runs on CPU.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import IO

# Lines a GPU build of Triton prints on a machine without a CUDA driver and no option turns off.
CPU_ONLY_LINES = (
    "CudaDriverHelper has not been initialized.",  # core's CUDA block manager, created always
    "failed to allocate pinned system memory: no pinned memory pool",  # the pool we turned off
)
CPU_NOTE = ("vtoken: no CUDA driver on this machine: tritonserver runs on CPU (GPU metrics and "
            "CUDA memory pools off; its CUDA start-up messages are left out of this log)\n")


def has_cuda_driver() -> bool:
    """Whether the CUDA driver library loads (what Triton's GPU features need)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cpu_only_options() -> list[str]:
    """tritonserver options that keep a GPU build from looking for GPUs it cannot use."""
    return ["--allow-gpu-metrics", "false", "--pinned-memory-pool-byte-size", "0"]


def copy_log(source: IO[bytes], log_file: Path, cpu_only: bool) -> threading.Thread:
    """Copies ``source`` (the server's stdout + stderr) to ``log_file`` line by line on a daemon
    thread, leaving out ``CPU_ONLY_LINES`` if ``cpu_only`` (with ``CPU_NOTE`` first)."""

    def run() -> None:
        with open(log_file, "wb") as log:
            if cpu_only:
                log.write(CPU_NOTE.encode())
            for line in iter(source.readline, b""):
                if cpu_only and any(marker.encode() in line for marker in CPU_ONLY_LINES):
                    continue
                log.write(line)
                log.flush()
        source.close()

    thread = threading.Thread(target=run, name="tritonserver-log", daemon=True)
    thread.start()
    return thread
