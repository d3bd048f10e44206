# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/llmapi/mpi_session.py`` ``MpiPoolSession`` as 1.2 runs it.

- ``_start_mpi_pool`` creates ``MPIPoolExecutor(max_workers=n_workers, path=sys.path)`` (1.2-era
  copies, e.g. index ids 124997232, 50591024333): no ``env`` argument, so a worker's environment
  is what MPI captured when it initialised in the client (``tensorrt_llm._utils``), not the
  client's ``os.environ`` now. (TensorRT-LLM's 2026 ``main``, commit 00a1352a, forwards only
  ``TRTLLM*`` / ``TLLM*`` variables.)
- mpi4py starts each worker as ``sys.executable -m mpi4py.futures.server`` (mpi4py
  ``futures/_core.py`` ``client_spawn``, commit 7c8dac2c): an ordinary interpreter start, so
  ``site`` processes the ``.pth`` files of site-packages; ``path`` is appended to ``sys.path`` in
  Python afterwards (``_sync_set_data``).
Here each worker is a subprocess started that way (``pool_worker`` plays ``mpi4py.futures.server``)
with that environment; tasks and results travel pickled, as through MPI."""

from __future__ import annotations

import pickle
import subprocess
import sys

from .. import _utils


class MpiPoolSession:
    def __init__(self, n_workers: int) -> None:
        if n_workers <= 0:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        self.n_workers = n_workers

    def submit_sync(self, task, *args, **kwargs) -> list:
        package = __name__.rsplit(".", 2)[0]  # "tensorrt_llm" (or its test-package path)
        results = []
        for rank in range(self.n_workers):
            environ = dict(_utils.MPI_INIT_ENVIRON, TLLM_DOUBLE_RANK=str(rank))
            done = subprocess.run([sys.executable, "-m", f"{package}.llmapi.pool_worker"],
                                  input=pickle.dumps((task, args, kwargs, list(sys.path))),
                                  env=environ, capture_output=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"MPI worker {rank} died:\n{done.stderr.decode()[-4000:]}")
            ok, value = pickle.loads(done.stdout)
            if not ok:
                raise value
            results.append(value)
        return results

    def shutdown(self, wait: bool = True) -> None:
        return None
