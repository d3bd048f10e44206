# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

# One thread per engine, here and in the server: the test machine's cores are shared, and OpenMP
# threads that spin waiting for each other slow the real model down several times over there.
# (The same count on both sides also keeps their float sums, hence their greedy tokens, equal.)
ENGINE_THREADS = 1

SERVER_PARAMETERS = {
    "variant": "vtoken", "policy": "h2o", "budget": "0.5", "num_blocks": "256",
    "max_batch_size": "32", "max_seq_len": "1024", "max_tokens_limit": "256",
}


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    """The real tritonserver (from nvidia-pytriton) on triton_model_repo, real model, CPU."""
    from trtllm_vtoken.runtime.checkpoint import ensure_default_model
    from trtllm_vtoken.serving.triton import (
        TritonServer,
        default_repository,
        free_ports,
        prepare_repository,
    )

    ensure_default_model()  # convert before the server's 180 s readiness clock starts
    scratch = tmp_path_factory.mktemp("triton")
    repository = prepare_repository(default_repository(), scratch / "repo", SERVER_PARAMETERS)
    server = TritonServer(repository, scratch, *free_ports(3), env={"OMP_NUM_THREADS": str(ENGINE_THREADS)})
    server.start()
    yield server
    assert server.stop() == 0 and server.stop_problem is None, (server.stop_problem, server.log_tail())
