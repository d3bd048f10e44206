# SPDX-License-Identifier: Apache-2.0
"""cpp/ configures and compiles wherever nvcc and cmake are present (the CUDA kernels are not run
without a GPU); the mass passes' fallback build, their AMX kind in software tiles and the built
core's tile configurations."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The C++ mass passes' sources, for the test builds that compile them on their own.
MASS_SOURCES = [str(ROOT / "cpp" / "core" / name)
                for name in ("amx.cpp", "prefill_mass.cpp", "prefill_pack.cpp", "decode_mass.cpp")]


@pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cmake")), reason="needs nvcc and cmake")
def test_cuda_kernels_compile(tmp_path):
    build = tmp_path / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT / "cpp"), "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=90-real",
         "-DVTOKEN_NATIVE_CORE=OFF"],  # the C++ core is built (and tested) by the install
        capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    assert "building the CUDA relocation kernel" in configure.stdout
    compiled = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert (build / "libvtoken_relocate.so").exists() and (build / "relocate_kv_check").exists()
    assert (build / "rerotate_k_check").exists()
    exported = subprocess.run(["nm", "-D", str(build / "libvtoken_relocate.so")], capture_output=True, text=True)
    assert "vtoken_relocate_kv" in exported.stdout and "vtoken_rerotate_k" in exported.stdout


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
def test_flat_index_and_chunked_array_agree_with_std_containers(tmp_path):
    binary = tmp_path / "flat_index_test"
    compiled = subprocess.run(["g++", "-O1", "-std=c++17", "-Wall", "-Werror", "-o", str(binary),
                               str(ROOT / "cpp" / "tests" / "flat_index_test.cpp")], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    ran = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "PASS" in ran.stdout, ran.stdout + ran.stderr


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
def test_the_mass_passes_build_and_step_aside_without_amx(tmp_path):
    """cpp/core's mass passes where the compiler or target has no AMX intrinsics (-DVTOKEN_AMX=0): they
    compile, say they are unsupported, and refuse to run (the package then takes the torch passes)."""
    binary = tmp_path / "mass_fallback_test"
    compiled = subprocess.run(["g++", "-O1", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-DVTOKEN_AMX=0", "-o",
                               str(binary), str(ROOT / "cpp" / "tests" / "mass_fallback_test.cpp"),
                               *MASS_SOURCES,
                               "-pthread"],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    ran = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and "PASS" in ran.stdout, ran.stdout + ran.stderr


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
def test_the_amx_kind_computes_the_mass_in_software_tiles(tmp_path):
    """The AMX kind of both bf16 mass passes, on a CPU without AMX: cpp/tests/tile_emulation.h
    stands in for the tile instructions (with the hardware's shape checks), and each kind must
    equal a double-precision softmax to 2e-4 on 300 random prefill and decode cases
    (cpp/tests/amx_emulation_test.cpp). -Wno-maybe-uninitialized: GCC 12 warns inside its own
    _mm512_undefined_ps."""
    binary = tmp_path / "amx_emulation_test"
    compiled = subprocess.run(["g++", "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-Wno-maybe-uninitialized",
                               "-include", str(ROOT / "cpp" / "tests" / "tile_emulation.h"), "-o", str(binary),
                               str(ROOT / "cpp" / "tests" / "amx_emulation_test.cpp"),
                               *MASS_SOURCES,
                               "-pthread"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    ran = subprocess.run([str(binary), "150"], capture_output=True, text=True, timeout=120)
    if ran.stdout.startswith("SKIP"):
        pytest.skip(ran.stdout.strip())
    assert ran.returncode == 0 and "PASS" in ran.stdout, ran.stdout + ran.stderr


# Bytes a store writes: by the mnemonic where it says (scalar and half-register moves), else by the
# register it stores (AT&T names), or for an immediate by the size suffix.
_NUMBERED = [f"r{n}" for n in range(8, 16)]
_REGISTER_BYTES = {
    **{f"r{r}": 8 for r in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp")}, **{r: 8 for r in _NUMBERED},
    **{f"e{r}": 4 for r in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp")}, **{f"{r}d": 4 for r in _NUMBERED},
    **{r: 2 for r in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp")}, **{f"{r}w": 2 for r in _NUMBERED},
    **{r: 1 for r in ("al", "bl", "cl", "dl", "ah", "bh", "ch", "dh", "sil", "dil", "bpl", "spl")},
    **{f"{r}b": 1 for r in _NUMBERED}}
_MNEMONIC_BYTES = {"movd": 4, "movss": 4, "movq": 8, "movsd": 8, "movlps": 8, "movhps": 8, "movlpd": 8, "movhpd": 8}
_STORE = re.compile(r"^(v?mov\w*)\s+(\S+),(-?0x[0-9a-f]+|-?\d+)?\(%(\w+)\)$")
_OPERAND = re.compile(r"ldtilecfg\s+(-?0x[0-9a-f]+|-?\d+)?\(%(\w+)\)")


def _store_bytes(mnemonic: str, source: str) -> int | None:
    named = _MNEMONIC_BYTES.get(mnemonic.removeprefix("v"))
    if named is not None:
        return named
    if source.startswith("$"):
        return {"b": 1, "w": 2, "l": 4, "q": 8}.get(mnemonic[-1])
    register = source.lstrip("%")
    vector = {"zmm": 64, "ymm": 32, "xmm": 16}.get(register[:3])
    return vector or _REGISTER_BYTES.get(register)


@pytest.mark.skipif(not shutil.which("g++"), reason="needs g++")
def test_both_decode_scorers_prefetch_each_next_block(tmp_path):
    """The decode pass asks for the next block's keys while it scores a block (they lie anywhere
    in the pool). Compiled as the core's Release build compiles it (-O3), the AMX and the AVX-512
    BF16 scorer each hold prefetches: with prefetch_next_block a function of its own, GCC 12 found
    it free of side effects and deleted its calls (the AMX pass took 526-540 ms instead of 345-350
    at batch 64 x 4k on a Xeon with AMX)."""
    listing = tmp_path / "decode_mass.s"
    compiled = subprocess.run(["g++", "-O3", "-DNDEBUG", "-std=c++17", "-fPIC", f"-I{ROOT / 'cpp' / 'core'}", "-S",
                               "-o", str(listing), str(ROOT / "cpp" / "core" / "decode_mass.cpp")],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    text = listing.read_text()
    for scorer in ("10score_keysE", "14score_keys_dotE"):
        start = re.search(rf"^_ZN6vtoken12_GLOBAL__N_1{scorer}\S*:$", text, re.MULTILINE)
        if start is None:
            pytest.skip("this compiler builds the mass passes without AMX intrinsics")
        body = text[start.end():text.index(".cfi_endproc", start.end())]
        assert "prefetcht0" in body, scorer


@pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump")
def test_every_byte_of_a_tile_configuration_is_stored_before_ldtilecfg():
    """ldtilecfg reads a 64-byte record. GCC 11 and 12's _tile_loadconfig names 8 of them as its
    operand, and GCC 12.2 at -O3 dropped the stores of every tile's rows and bytes per row: on an AMX
    CPU the tiles would fault or be empty. In the built core, the stores before each ldtilecfg
    (back to the function's start, its label or ret, or the ldtilecfg before) must cover all 64
    bytes of its operand. A store this test cannot size, or an operand it cannot read, fails it."""
    import torch

    import trtllm_vtoken._native._core as core
    from trtllm_vtoken.integration.trtllm.mass_cpp import prefill_kind

    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", core.__file__], capture_output=True, text=True,
                             check=True).stdout
    configurations, since = 0, []
    for line in listing.splitlines():
        instruction = line.split("\t", 1)[1].strip() if "\t" in line else ""
        if instruction.startswith("ldtilecfg"):
            operand = _OPERAND.fullmatch(instruction)
            assert operand, f"an ldtilecfg operand this test cannot read: {instruction!r}"
            record, base = int(operand.group(1) or "0", 0), operand.group(2)
            stored = set()
            for earlier in since:
                store = _STORE.match(earlier)
                if store and store.group(4) == base:
                    width = _store_bytes(store.group(1), store.group(2))
                    assert width, f"a store this test cannot size: {earlier!r}"
                    start = int(store.group(3) or "0", 0)
                    stored.update(range(start, start + width))
            missing = sorted(set(range(record, record + 64)) - stored)
            assert not missing, f"bytes {[m - record for m in missing]} of a tile configuration are never stored"
            configurations += 1
        if not instruction or instruction.startswith(("ret", "ldtilecfg")):
            since.clear()  # a label, a function's end or the record before: the next record starts here
        else:
            since.append(instruction)
    if configurations == 0 and prefill_kind(torch.float32) is None:
        pytest.skip("this core was built without the AVX-512 and AMX code")  # -DVTOKEN_AMX=0, or not x86-64
    assert configurations >= 2  # prefill_mass.cpp's and decode_mass.cpp's configure_tiles, perhaps inlined twice
