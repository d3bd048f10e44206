# SPDX-License-Identifier: Apache-2.0
"""On a CUDA device: a batch's decode mass and its copy to the host are enqueued without the host
waiting for the stream, and reading the copy back waits for its mark only, not for work enqueued
after it. The executor-loop double proves the order with a model of the stream
(``test_trtllm_executor_loop.py``); this is the same order on a real stream, where torch's sync
debug mode ("error") turns any implicit synchronisation (a blocking upload, a blocking copy to the
host) into an error. Run by ``scripts/gpu_checks.sh``; skipped without a GPU.

    stream:  sleep (forward N) | mass(N), copy, mark | sleep (forward N+1)
    host:    enqueue mass(N) while forward N runs .... read mass(N) while forward N+1 runs
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.test_mass_passes import random_decode
from trtllm_vtoken.integration.trtllm.mass import decode_mass
from trtllm_vtoken.integration.trtllm.mass_copy import MassCopy, StreamMarks
from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass
from trtllm_vtoken.reclaim.upload import to_device

pytestmark = pytest.mark.cuda

FORWARD_CYCLES = 500_000_000
"""A stand-in forward: ``torch.cuda._sleep`` spins this many GPU cycles (~0.3 s at 1.8 GHz),
far longer than the host needs to enqueue and read a mass."""


def sync_debug(mode: str):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    return previous


def test_uploads_do_not_wait_for_the_stream():
    previous = sync_debug("error")
    try:
        torch.cuda._sleep(FORWARD_CYCLES)
        busy = torch.cuda.Event()
        busy.record()
        table = to_device(np.arange(12).reshape(3, 4), torch.int64, "cuda")
        lens = to_device([5, 6, 7], torch.int32, "cuda")
        returned_while_busy = not busy.query()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert returned_while_busy
    assert table.cpu().tolist() == np.arange(12).reshape(3, 4).tolist() and table.dtype == torch.int64
    assert lens.cpu().tolist() == [5, 6, 7] and lens.dtype == torch.int32


@pytest.mark.parametrize("seed", range(3))
def test_the_mass_is_enqueued_and_read_without_waiting_for_later_work(seed):
    q, pool, block_lists, kv_lens, layers = random_decode(seed, torch.bfloat16)
    want = batch_decode_attention_mass(q, pool, block_lists, kv_lens, layers).numpy()
    q, pool = q.cuda(), pool.cuda()
    rows = [(i, n, blocks) for i, (n, blocks) in enumerate(zip(kv_lens, block_lists))]
    stream = StreamMarks("cuda")
    MassCopy(rows, decode_mass(q, pool, block_lists, kv_lens, layers), stream).rows(rows, max(kv_lens))  # warm-up
    previous = sync_debug("error")
    try:
        torch.cuda._sleep(FORWARD_CYCLES)  # forward N, in flight
        forward = torch.cuda.Event()
        forward.record()
        copy = MassCopy(rows, decode_mass(q, pool, block_lists, kv_lens, layers), stream)  # prepare_resources(N+1)
        enqueued_during_forward = not forward.query()
        torch.cuda._sleep(FORWARD_CYCLES)  # forward N+1
        next_forward = torch.cuda.Event()
        next_forward.record()
        got = copy.rows(rows, max(kv_lens))  # update_resources(N)
        read_during_next_forward = not next_forward.query()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert enqueued_during_forward and read_during_next_forward
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
