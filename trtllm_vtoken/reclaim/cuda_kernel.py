# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels, loaded through their plain C ABI from one library:

    vtoken_relocate_kv   (cpp/cuda/relocate_kv.cu) moves a plan's token slots in every layer, K and
                         V, in one launch; ``relocate_slots`` in ``copy.py`` is its specification
                         (bit-exact)
    vtoken_rerotate_k    (cpp/cuda/rerotate_k.cu) turns the keys at given slots back by given
                         positions (position-shift mode); ``rerotate_slots`` in ``rerotate.py`` is
                         its specification (equal up to the last bit of a cosine)

Both enqueue on a given stream and return at once. The library is optional: it is
built by ``cpp/CMakeLists.txt`` where nvcc is present and found, in this order, at
``$VTOKEN_RELOCATE_LIB``, next to the installed C++ core (an editable install keeps compiled files
outside the source tree), or in ``trtllm_vtoken/_native/``. Without it, the
torch copy executor falls back to torch indexing on CUDA. Nothing here imports torch's CUDA parts
at import time.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trtllm_vtoken.reclaim.rope import RopeSpec

ABI_VERSION = 2
LIBRARY_NAME = "libvtoken_relocate.so"


def library_path() -> Path | None:
    """Where the kernel library is, or None if it was not built."""
    import importlib.util

    explicit = os.environ.get("VTOKEN_RELOCATE_LIB")
    if explicit:
        return Path(explicit)
    folders = [Path(__file__).resolve().parent.parent / "_native"]
    core = importlib.util.find_spec("trtllm_vtoken._native._core")
    if core is not None and core.origin:
        folders.insert(0, Path(core.origin).parent)
    return next((f / LIBRARY_NAME for f in folders if (f / LIBRARY_NAME).exists()), None)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded library, or None if absent. Raises RuntimeError for a broken or foreign one."""
    path = library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise RuntimeError(f"cannot load the CUDA relocation kernel {path}: {exc}") from None
    lib.vtoken_relocate_kv_abi_version.restype = ctypes.c_int
    if lib.vtoken_relocate_kv_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI {lib.vtoken_relocate_kv_abi_version()}, expected {ABI_VERSION}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.vtoken_relocate_kv.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr]
    lib.vtoken_relocate_kv.restype = ctypes.c_int
    i32 = ctypes.c_int
    lib.vtoken_rerotate_k.argtypes = [ptr, i32, i64, i64, i64, i64, i64, i32, ptr, ptr, ptr, i64, ptr]
    lib.vtoken_rerotate_k.restype = ctypes.c_int
    return lib


def describe() -> str:
    """One line for ``vtoken info``."""
    try:
        lib = load()
    except RuntimeError as exc:
        return f"broken ({exc})"
    return f"loaded from {library_path()}" if lib is not None else "not built (torch indexing on CUDA)"


def relocate_slots_cuda(pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                        stream: Any = None) -> None:
    """Enqueues ``pool[dst] = pool[src]`` (every layer, K and V) on ``stream`` (default: current).

    Args:
        pool: contiguous CUDA tensor [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block,
            head_dim], fp32/fp16/bf16; modified.
        src_slots, dst_slots: [num_moves] int64 on the pool's device; destinations distinct and
            disjoint from the sources (what the planner produces).
    Raises:
        RuntimeError if the library is absent or the launch fails; ValueError for bad arguments.
    """
    import torch

    lib = _checked_launch(pool, src_slots=src_slots, dst_slots=dst_slots)
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"{src_slots.numel()} sources but {dst_slots.numel()} destinations")
    num_blocks, layers, kv, heads, tpb, head_dim = pool.shape
    stream = stream if stream is not None else torch.cuda.current_stream(pool.device)
    err = lib.vtoken_relocate_kv(
        pool.data_ptr(), layers * kv * heads, tpb, head_dim * pool.element_size(),
        src_slots.data_ptr(), dst_slots.data_ptr(), src_slots.numel(), stream.cuda_stream,
    )
    if err != 0:
        raise RuntimeError(f"vtoken_relocate_kv failed with CUDA error {err}")


def _checked_launch(pool: torch.Tensor, **indices: torch.Tensor) -> ctypes.CDLL:
    """The loaded library, after checking a launch's pool and index arrays. RuntimeError if the
    library is absent, ValueError for a pool that is not a contiguous 6-D CUDA tensor or an index
    array that is not a contiguous 1-D int64 tensor on its device."""
    import torch

    lib = load()
    if lib is None:
        raise RuntimeError("the CUDA kernels are not built (see cpp/CMakeLists.txt)")
    if not pool.is_cuda or pool.dim() != 6 or not pool.is_contiguous():
        raise ValueError(f"pool must be a contiguous 6-D CUDA tensor, got {tuple(pool.shape)} on {pool.device}")
    for name, values in indices.items():
        if values.dtype != torch.int64 or values.device != pool.device or values.dim() != 1 or not values.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int64 tensor on {pool.device}")
    return lib


_DTYPE_CODES = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}


def rerotate_keys_cuda(pool: torch.Tensor, slots: torch.Tensor, shifts: torch.Tensor, rope: RopeSpec,
                       stream: Any = None) -> None:
    """Enqueues the re-rotation of the keys at ``slots`` by ``-shifts`` positions on ``stream``
    (default: current), every layer and head.

    Args:
        pool: contiguous CUDA tensor [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block,
            head_dim], fp32/fp16/bf16; modified.
        slots, shifts: [S] int64 on the pool's device; slots distinct.
    Raises:
        RuntimeError if the library is absent or the launch fails; ValueError for bad arguments.
    """
    import torch

    lib = _checked_launch(pool, slots=slots, shifts=shifts)
    if str(pool.dtype) not in _DTYPE_CODES:
        raise ValueError(f"pool dtype must be float32, float16 or bfloat16, got {pool.dtype}")
    if slots.numel() != shifts.numel():
        raise ValueError(f"{slots.numel()} slots but {shifts.numel()} shifts")
    _, layers, _, heads, tpb, head_dim = pool.shape
    if head_dim != rope.head_dim:
        raise ValueError(f"pool head_dim {head_dim} != RoPE head_dim {rope.head_dim}")
    stream = stream if stream is not None else torch.cuda.current_stream(pool.device)
    with torch.cuda.stream(stream):  # made, and freed, in the launch's stream order
        inv_freq = rope.inv_freq(pool.device).contiguous()
    err = lib.vtoken_rerotate_k(
        pool.data_ptr(), _DTYPE_CODES[str(pool.dtype)], layers, heads, tpb, head_dim, rope.rotary_dim,
        0 if rope.style == "neox" else 1, inv_freq.data_ptr(), slots.data_ptr(), shifts.data_ptr(),
        slots.numel(), stream.cuda_stream,
    )
    if err != 0:
        raise RuntimeError(f"vtoken_rerotate_k failed with CUDA error {err}")
