# SPDX-License-Identifier: Apache-2.0
"""Compiled parts, installed here by the package's build (cpp/CMakeLists.txt): ``_core`` (the C++
token table) and ``libvtoken_relocate.so`` (the CUDA relocation kernel). Both are optional."""
