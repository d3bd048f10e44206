# SPDX-License-Identifier: Apache-2.0
"""Position-shift mode in the reference runtime (tiny random model): new tokens take their
physical position, compaction turns the surviving keys back, and every policy in both compaction
modes decodes as in keep mode (same greedy tokens, logits equal to float32 rounding)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.runtime.test_engine import POLICY_OPTIONS, config, prompts
from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def generate(model, positions: str, device: str = "cpu", **overrides):
    cfg = config(positions=positions, device=device, **overrides)
    engine = Engine(model, cfg, record_trace=True)
    ids = [engine.add_request(p, PARAMS) for p in prompts(3)]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    return engine, [engine.pop_finished(i) for i in ids]


@pytest.mark.parametrize("mode", ["dense", "lazy"])
@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
def test_shift_decodes_as_keep(model, policy, mode):
    options = POLICY_OPTIONS.get(policy, {})
    _, keep = generate(model, "keep", policy=policy, mode=mode, policy_options=options)
    engine, shift = generate(model, "shift", policy=policy, mode=mode, policy_options=options)
    assert engine.kv.rerotation.stats.passes > 0, "no compaction shortened a request: nothing tested"
    for a, b in zip(keep, shift):
        assert a.output_ids == b.output_ids and a.evictions == b.evictions
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-4)


def test_without_rerotation_shift_positions_change_the_output(model):
    """The check above can fail: physical positions without turning the keys back diverge."""
    _, keep = generate(model, "keep", policy="streaming_llm", policy_options=POLICY_OPTIONS["streaming_llm"])
    engine = Engine(model, config(positions="shift", policy="streaming_llm",
                                  policy_options=POLICY_OPTIONS["streaming_llm"]), record_trace=True)
    engine.kv.rerotation.shift_requests = lambda *args: 0  # positions shift, keys stay
    ids = [engine.add_request(p, PARAMS) for p in prompts(3)]
    while engine.has_unfinished():
        engine.step()
    broken = [engine.pop_finished(i) for i in ids]
    assert max(float((x - y).abs().max()) for a, b in zip(keep, broken) for x, y in zip(a.logits, b.logits)) > 1e-2


def test_positions_follow_the_mode(model):
    """A request's next RoPE position: logical in keep mode, physical (kv_len) in shift mode."""
    for positions in ("keep", "shift"):
        engine = Engine(model, config(positions=positions, policy="sliding_window", budget=8))
        req = engine.add_request(list(range(20)), PARAMS)
        for _ in range(3):
            engine.step()
        table = engine.kv.step
        assert table.num_tokens(req) == 22 and table.kv_len(req) == 8
        assert engine.kv.next_position(req) == (22 if positions == "keep" else 8)


def test_rerotation_time_is_its_own_part_of_the_step(model):
    """Turning the keys back is counted as "rerotate", not as the invariant checks it follows."""
    engine = Engine(model, config(positions="shift", policy="streaming_llm", check_invariants=False,
                                  policy_options=POLICY_OPTIONS["streaming_llm"]))
    turn, calls = engine.kv.rerotation.shift_requests, []

    def slow_turn(*args):  # 10 ms more per pass: far above what the rest of a step's parts take
        calls.append(time.sleep(0.01))
        return turn(*args)

    engine.kv.rerotation.shift_requests = slow_turn
    for p in prompts(3):
        engine.add_request(p, PARAMS)
    while engine.has_unfinished():
        engine.step()
    seconds = engine.kv.step_stats.seconds
    assert calls and seconds["rerotate"] >= 0.01 * len(calls)
    assert seconds["checks"] < 0.005 * len(calls)


def test_keep_mode_never_rerotates(model):
    engine, _ = generate(model, "keep")
    assert engine.kv.rerotation is None


def test_positions_setting_is_validated():
    with pytest.raises(ValueError, match="positions must be 'keep' or 'shift'"):
        EngineConfig(positions="physical")
    with pytest.raises(ValueError, match="unknown EngineConfig key"):
        EngineConfig.from_dict({"position": "shift"})


@pytest.mark.cuda
def test_shift_decodes_as_keep_on_cuda_with_graphs(model):
    _, keep = generate(model, "keep", device="cuda", policy="h2o")
    engine, shift = generate(model, "shift", device="cuda", policy="h2o")
    assert engine.graphs is not None and engine.kv.rerotation.stats.passes > 0
    for a, b in zip(keep, shift):
        assert a.output_ids == b.output_ids
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-3)
