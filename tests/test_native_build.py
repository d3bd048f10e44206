# SPDX-License-Identifier: Apache-2.0
"""cpp/ configures and compiles wherever nvcc and cmake are present (nothing runs without a GPU)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
                               *(str(ROOT / "cpp" / "core" / name) for name in ("amx.cpp", "prefill_mass.cpp",
                                                                                 "prefill_pack.cpp", "decode_mass.cpp")),
                               "-pthread"],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    ran = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and "PASS" in ran.stdout, ran.stdout + ran.stderr
