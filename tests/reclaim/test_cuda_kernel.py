# SPDX-License-Identifier: Apache-2.0
"""The CUDA relocation kernel: bit-exact against ``relocate_slots`` (its specification) for every
pool dtype; its loader refuses a broken library with a clear error."""

from __future__ import annotations

import zlib

import pytest
import torch

from trtllm_vtoken.reclaim import cuda_kernel
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor, relocate_slots


@pytest.fixture
def fresh_loader():
    cuda_kernel.load.cache_clear()
    yield
    cuda_kernel.load.cache_clear()


def test_missing_library_is_a_clear_error(fresh_loader, monkeypatch, tmp_path):
    monkeypatch.setenv("VTOKEN_RELOCATE_LIB", str(tmp_path / "libvtoken_relocate.so"))
    with pytest.raises(RuntimeError, match="cannot load the CUDA relocation kernel"):
        cuda_kernel.load()
    assert cuda_kernel.describe().startswith("broken")


def test_executor_rejects_unknown_kernel_choice():
    with pytest.raises(ValueError, match="kernel must be"):
        TorchCopyExecutor([torch.zeros(2, 1, 2, 1, 4, 8)], kernel="triton")


def _random_plan(num_slots: int, moves: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct destinations, none of them a source: what the planner produces."""
    perm = torch.randperm(num_slots, generator=gen)
    dst = perm[:moves]
    src = perm[moves:][torch.randint(0, num_slots - moves, (moves,), generator=gen)]
    return src, dst


needs_kernel = pytest.mark.skipif(cuda_kernel.library_path() is None, reason="CUDA relocation kernel not built")


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 2, 2, 2, 16, 16), (24, 30, 2, 3, 16, 64), (12, 4, 2, 8, 32, 128),
                                   (30, 3, 2, 1, 48, 5)])
def test_kernel_is_bit_exact_with_the_reference(dtype, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{shape}".encode()))
    pool = torch.randn(shape, generator=gen).to(dtype)
    num_slots = shape[0] * shape[4]
    for moves in (1, 7, num_slots // 3):
        src, dst = _random_plan(num_slots, moves, gen)
        expected = pool.clone()
        relocate_slots(expected, src, dst)
        gpu = pool.cuda()
        cuda_kernel.relocate_slots_cuda(gpu, src.cuda(), dst.cuda())
        torch.cuda.synchronize()
        assert torch.equal(gpu.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.cuda
@needs_kernel
def test_kernel_rejects_bad_arguments():
    pool = torch.zeros(4, 1, 2, 1, 4, 8, device="cuda")
    slots = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="contiguous 6-D CUDA"):
        cuda_kernel.relocate_slots_cuda(pool.cpu(), slots, slots)
    with pytest.raises(ValueError, match="int64"):
        cuda_kernel.relocate_slots_cuda(pool, slots.int(), slots)
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        cuda_kernel.relocate_slots_cuda(pool, slots, slots[:1])


@pytest.mark.cuda
@needs_kernel
def test_executor_uses_the_kernel_and_matches_torch_indexing():
    from tests.helpers import add_sequence, make_kv, make_table
    from trtllm_vtoken.reclaim.planner import plan_dense

    pool, table = make_table()
    kv = make_kv(pool, dtype=torch.bfloat16).cuda()
    add_sequence(pool, table, 0, 14)
    table.evict_tokens(0, [0, 3, 5, 9])
    plan = plan_dense(table, 0)
    by_kernel, by_torch = kv.clone(), kv.clone()
    kernel = TorchCopyExecutor([by_kernel], kernel="cuda")
    assert kernel.uses_kernel
    kernel.submit(plan).synchronize()
    TorchCopyExecutor([by_torch], kernel="torch").submit(plan).synchronize()
    assert torch.equal(by_kernel, by_torch)
