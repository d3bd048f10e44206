# SPDX-License-Identifier: Apache-2.0
"""The Triton mass kernels (``mass_triton.py``) build well for the GPUs TensorRT-LLM runs on,
checked here without one.

Each case runs one of the launchers at a model's shapes on CPU tensors; every launch it makes is
compiled, not run, by Triton's own compiler and NVIDIA backend (down to ptxas' SASS) for one
architecture: ``JITFunction.warmup`` with the launch's grid, arguments and options, the path a
CUDA launch compiles by. Compiling asks the CUDA driver for one thing, the target, which
``ArchitectureDriver`` answers. Each compiled kernel must

- fit the shared memory one block may have on that architecture (a launch past it fails:
  Triton's ``OutOfResources``),
- keep its values in registers (a spill is a store to local memory, STL, in the SASS),
- form half and FP8 scores on the tensor cores (an MMA instruction in the SASS).

``test_mass_triton.py`` checks the kernels' values (interpreter here, CUDA in
``scripts/gpu_checks.sh``); this checks what only a GPU's compiler decides. Before these checks
the decode kernel held a [group, tokens, head_dim] product in registers (thousands of spilled
stores at Llama-3.1-70B and Qwen2.5-7B shapes on every architecture) and the prefill kernels
asked the 99 KiB parts for more shared memory than they grant at head_dim 256: 35 of these cases
failed.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402  (after the skip: Triton is optional)
from triton.runtime.driver import driver  # noqa: E402

from trtllm_vtoken.integration.trtllm import mass_triton  # noqa: E402

# Shared memory one block may opt in to, per compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability": 163 KB on 8.0, 99 KB on 8.6 / 8.9 / 12.0,
# 227 KB on 9.0 / 10.0): what Triton compares a kernel's ``metadata.shared`` with at launch.
# sm_86 builds as sm_89 does (the same MMA, the same limit) bar FP8, so it is left out.
SHARED_BYTES = {80: 163 << 10, 89: 99 << 10, 90: 227 << 10, 100: 227 << 10, 120: 99 << 10}
ARCHITECTURES = {80: "A100", 89: "L40S", 90: "H100/H200", 100: "B200", 120: "RTX PRO 6000"}

# (heads, KV heads, head_dim), from each model's config.json.
MODELS = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128), "llama-3.1-70b": (64, 8, 128),
          "qwen2.5-7b": (28, 4, 128), "gemma-2-9b": (16, 8, 256), "phi-3-mini": (32, 32, 96)}

# Decode cases: (model, pool dtype, tokens_per_block); FP8 pools meet float32 queries, as the
# manager scales them. Prefill cases: (model, dtype, reused prefix).
DECODE = [("smollm2-135m", torch.bfloat16, 32), ("llama-3.1-8b", torch.bfloat16, 32),
          ("llama-3.1-70b", torch.bfloat16, 64), ("qwen2.5-7b", torch.float16, 128),
          ("llama-3.1-8b", torch.float8_e4m3fn, 32), ("smollm2-135m", torch.float32, 16),
          ("gemma-2-9b", torch.bfloat16, 32)]
PREFILL = [("smollm2-135m", torch.bfloat16, False), ("llama-3.1-70b", torch.bfloat16, True),
           ("gemma-2-9b", torch.bfloat16, False), ("phi-3-mini", torch.float16, False),
           ("llama-3.1-8b", torch.float32, False), ("gemma-2-9b", torch.float32, False),
           ("smollm2-135m", torch.float32, True)]
# sm_90 (the H100 / H200 of gpu_checks.sh) builds every case; the others the cases that push
# their limits: the widest tiles, float32, FP8 (sm_89 and later: TensorRT-LLM's and Triton's FP8).
WIDEST = {("decode", 2), ("decode", 3), ("decode", 4), ("prefill", 2), ("prefill", 4), ("prefill", 5)}


def cases():
    for kind, table in (("decode", DECODE), ("prefill", PREFILL)):
        for index, (model, dtype, extra) in enumerate(table):
            for arch in SHARED_BYTES:
                if (arch == 90 or (kind, index) in WIDEST) and not (dtype.itemsize == 1 and arch < 89):
                    name = f"sm_{arch}-{kind}-{model}-{str(dtype).removeprefix('torch.')}"
                    yield pytest.param(arch, kind, model, dtype, extra, id=name)


class ArchitectureDriver:
    """Stands in for Triton's CUDA driver (``triton/backends/nvidia/driver.py``, ``CudaDriver``)
    in what ``JITFunction.run`` (``triton/runtime/jit.py``) asks of it before compiling:
    ``get_current_device`` and ``get_current_stream`` (torch's, which key the kernel cache and
    would take a launch: here a key of this architecture's own, so no real device's cache is
    touched) and, through ``create_binder``, ``get_current_target``: ``GPUTarget("cuda",
    major * 10 + minor, 32)`` of the device, here the architecture under test."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> str:
        return f"sm_{self.arch}"

    def get_current_stream(self, device=None) -> int:
        return 0


class CompileOnly:
    """A kernel as the launchers call it (``kernel[grid](*args, **options)``: Triton's
    ``KernelInterface.__getitem__`` in ``triton/runtime/jit.py``, which runs ``run(..., warmup=False)``),
    compiling instead of launching through the same ``run`` (``warmup``); the compiled kernels are
    kept in ``built``."""

    def __init__(self, kernel, built: list) -> None:
        self.kernel, self.built = kernel, built

    def __getitem__(self, grid):
        def compile_launch(*args, **kwargs):
            self.built.append(self.kernel.warmup(*args, grid=grid, **kwargs))
        return compile_launch


def build(monkeypatch, arch: int, launch) -> list:
    """The kernels ``launch()`` would run, compiled for ``arch``."""
    built: list = []
    for name in ("_decode_scores_kernel", "_decode_mass_kernel", "_prefill_lse_kernel", "_prefill_mass_kernel"):
        monkeypatch.setattr(mass_triton, name, CompileOnly(getattr(mass_triton, name), built))
    driver.set_active(ArchitectureDriver(arch))
    try:
        launch()
    finally:
        try:
            driver.reset_active()
        except RuntimeError:  # no CUDA driver on this machine: none is active, as before
            driver.set_active(None)
    return built


def decode_launch(model: str, dtype: torch.dtype, tpb: int):
    heads, kv_heads, dim = MODELS[model]
    rows, layers = 3, 2  # counts other than 1, which Triton would compile as constants
    q = torch.randn(rows, layers, heads, dim, dtype=torch.float32 if dtype.itemsize == 1 else dtype)
    pool = torch.zeros(8, layers, 2, kv_heads, tpb, dim, dtype=dtype)
    block_lists = [[0, 1], [2, 3], [4]]
    return lambda: mass_triton.decode_mass_triton(q, pool, block_lists, [tpb + 3, 2 * tpb - 1, tpb - 2])


def prefill_launch(model: str, dtype: torch.dtype, reused: bool):
    heads, kv_heads, dim = MODELS[model]
    q, k = torch.randn(37, heads, dim, dtype=dtype), torch.randn(37, kv_heads, dim, dtype=dtype)
    past_k = torch.randn(21, kv_heads, dim, dtype=dtype) if reused else None
    return lambda: mass_triton.prefill_mass_triton(q, k, past_k)


@pytest.mark.parametrize("arch, kind, model, dtype, extra", list(cases()))
def test_kernels_fit_the_architecture_in_registers_and_on_tensor_cores(monkeypatch, arch, kind, model, dtype, extra):
    launch = decode_launch(model, dtype, extra) if kind == "decode" else prefill_launch(model, dtype, extra)
    built = build(monkeypatch, arch, launch)
    assert len(built) == 2
    tensor_cores = dtype != torch.float32
    for kernel in built:
        name, sass = kernel.metadata.name, kernel.asm["sass"]
        where = f"{name} for sm_{arch} ({ARCHITECTURES[arch]}), {model} {dtype}"
        assert kernel.metadata.shared <= SHARED_BYTES[arch], \
            f"{where}: {kernel.metadata.shared} bytes of shared memory, more than the {SHARED_BYTES[arch]} a block may have"
        spills = re.findall(r"\bSTL\b", sass)
        assert not spills, f"{where}: {len(spills)} stores of spilled registers"
        if name != "_decode_mass_kernel":  # the one kernel without a tile product
            mma = set(re.findall(r"(?<![\w.])[A-Z]*MMA\b", sass))  # an opcode, not HFMA2.MMA's pipe
            assert bool(mma) == tensor_cores, f"{where}: tensor-core instructions {sorted(mma)}"


def test_the_prefill_tiles_follow_the_dtype_and_head_dim():
    """The shapes the kernels above were built with (``prefill_tiles``)."""
    assert mass_triton.prefill_tiles(64, "half") == (64, 64, 3, 4)
    assert mass_triton.prefill_tiles(128, "half") == (64, 64, 3, 4)
    assert mass_triton.prefill_tiles(256, "half") == (64, 32, 3, 4)
    assert mass_triton.prefill_tiles(96, "split") == (64, 64, 3, 4)
    assert mass_triton.prefill_tiles(128, "ieee") == (32, 32, 1, 8)
    assert mass_triton.prefill_tiles(256, "ieee") == (32, 32, 1, 8)
    assert mass_triton.prefill_tiles(512, "ieee") == (32, 16, 1, 8)
