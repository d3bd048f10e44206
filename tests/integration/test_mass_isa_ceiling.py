# SPDX-License-Identifier: Apache-2.0
"""The ceiling on what the C++ mass passes use (``mass_cpp.limit_isa``, ``VTOKEN_MAX_CPU_ISA``;
``cpp/core/amx.cpp``): each level lets the passes use itself and the levels under it, never more
than the CPU has; a bad name is refused with nothing changed; the environment's ceiling holds from
the first question on, and a bad one is told on every question; under "none" every row takes the
torch pass and the mass is still its specification's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.integration.conftest import cpu_runs
from tests.integration.test_mass_passes import random_decode, random_prefill
from trtllm_vtoken.core import native
from trtllm_vtoken.integration.trtllm.mass import decode_mass, decode_pass, prefill_mass, prefill_pass
from trtllm_vtoken.integration.trtllm.mass_cpp import (ISA_LEVELS, bf16_kind, describe, isa_ceiling, isa_limited,
                                                       limit_isa, prefill_kind)
from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass, prefill_attention_mass

pytestmark = pytest.mark.skipif(native.load() is None or not hasattr(native.load(), "limit_mass_isa"),
                                reason="needs the C++ core")


@pytest.fixture(autouse=True)
def environment_ceiling():
    """Every test starts and ends at the environment's ceiling."""
    before = limit_isa(None)
    yield
    limit_isa(before)


def test_each_level_allows_itself_and_those_under_it():
    has = {level: cpu_runs(level) for level in ISA_LEVELS[1:]}
    want_bf16 = {"none": None, "avx512": None, "avx512-bf16": "avx512-bf16" if has["avx512-bf16"] else None,
                 "amx": "amx" if has["amx"] else "avx512-bf16" if has["avx512-bf16"] else None}
    for level in ISA_LEVELS:
        with isa_limited(level):
            assert isa_ceiling() == level
            assert bf16_kind() == want_bf16[level]
            fma = "avx512" if has["avx512"] and level != "none" else None
            assert prefill_kind(torch.float32) == prefill_kind(torch.float16) == fma
            assert prefill_kind(torch.bfloat16) == (want_bf16[level] or fma)
            assert level == "amx" or f"limited to {level}" in describe()
    assert "limited" not in describe()


def test_limits_nest_and_a_bad_name_changes_nothing():
    environment = isa_ceiling()
    assert limit_isa("avx512") is None  # it replaced the environment's
    with isa_limited("none"):
        assert isa_ceiling() == "none"
        with pytest.raises(ValueError, match="must be one of amx, avx512-bf16, avx512, none; got 'sse4'"):
            limit_isa("sse4")
        assert isa_ceiling() == "none"
    assert isa_ceiling() == "avx512"
    with pytest.raises(RuntimeError, match="raised inside"), isa_limited("amx"):
        raise RuntimeError("raised inside")
    assert limit_isa(None) == "avx512" and isa_ceiling() == environment


def test_under_none_every_row_takes_the_torch_pass_with_the_same_mass():
    q, pool, block_lists, kv_lens, layers = random_decode(2, torch.bfloat16)
    pq, pk, past_k, window = random_prefill(2, torch.bfloat16)
    with isa_limited("none"):
        assert decode_pass(q, pool, kv_lens) == "torch" and prefill_pass(pq, pk, past_k) == "torch"
        torch.testing.assert_close(decode_mass(q, pool, block_lists, kv_lens, layers),
                                   batch_decode_attention_mass(q, pool, block_lists, kv_lens, layers))
        torch.testing.assert_close(prefill_mass(pq, pk, past_k, window),
                                   prefill_attention_mass(pq, pk, past_k=past_k, window=window))


def ask_in_a_new_process(value: str) -> subprocess.CompletedProcess:
    code = ("from trtllm_vtoken.core import native\n"
            "core = native.load()\n"
            "for ask in (core.mass_isa_ceiling, core.bf16_mass_kind, core.mass_isa_ceiling):\n"
            "    try:\n"
            "        print(ask())\n"
            "    except ValueError as error:\n"
            "        print('ValueError:', error)\n"
            "core.limit_mass_isa('avx512')\n"
            "print(core.mass_isa_ceiling())\n")
    env = dict(os.environ, VTOKEN_MAX_CPU_ISA=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_the_environment_sets_the_first_ceiling_and_a_bad_one_is_told_each_time():
    ran = ask_in_a_new_process("none")
    assert ran.returncode == 0 and ran.stdout.split("\n") == ["none", "None", "none", "avx512", ""], ran.stderr
    ran = ask_in_a_new_process("amx2")
    told = "ValueError: VTOKEN_MAX_CPU_ISA must be one of amx, avx512-bf16, avx512, none; got 'amx2'"
    assert ran.returncode == 0 and ran.stdout.split("\n") == [told] * 3 + ["avx512", ""], ran.stderr
