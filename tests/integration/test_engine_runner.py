# SPDX-License-Identifier: Apache-2.0
"""vToken on the trtllm-build + Python runner path, over doubles of TensorRT-LLM 1.2's
ModelRunner / GenerationSession / pure-Python block manager and of the engine's GPT attention
plugin (tests/integration/trtllm_*_double12.py). The engine double rotates each new token by its
physical position, as the plugin does, so matching the reference runtime's keep-mode output
proves the rewritten tensors and the key re-rotation together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.trtllm_session_double12 import GenerationSessionDouble12, ModelRunnerDouble12
from trtllm_vtoken.integration.trtllm import offsets
from trtllm_vtoken.integration.trtllm.engine_runner import (
    EngineVToken,
    VTokenEngineRunner,
    check_engine_settings,
    physical_bound,
)
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB, END_ID, NEW = 4, 127, 20
OPTIONS = {"streaming_llm": {"n_sink": 2}}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, END_ID, (n,), generator=g) for n in (5, 13, 22)]


def settings(policy: str, budget, positions: str = "shift") -> VTokenSettings:
    return VTokenSettings(policy=policy, budget=budget, positions=positions, policy_options=OPTIONS.get(policy, {}),
                          check_invariants=True)


def runner(model, max_seq_len: int = 64) -> ModelRunnerDouble12:
    return ModelRunnerDouble12(GenerationSessionDouble12(model, TPB), max_batch_size=6, max_input_len=32,
                               max_seq_len=max_seq_len)


def generated(output_ids: torch.Tensor, batch: list[torch.Tensor]) -> list[list[int]]:
    rows = []
    for b, ids in enumerate(batch):
        row = output_ids[b, 0, len(ids):].tolist()
        rows.append(row[: row.index(END_ID)] if END_ID in row else row)
    return rows


def keep_mode_reference(model, policy: str, budget, batch, new: int = NEW) -> list:
    """The reference runtime, keep positions, same policy and budget, giving tokens up a block at a
    time as every TensorRT-LLM host does (one prompt each, as ids 0..n-1), each iteration's step
    before the next forward as the engine path's runner orders them."""
    engine = Engine(model, EngineConfig(policy=policy, budget=budget, tokens_per_block=TPB, num_blocks=256,
                                        eviction_unit=TPB, overlap_scheduler=False,
                                        max_batch_size=4, max_seq_len=256, policy_options=OPTIONS.get(policy, {})),
                    eos_token_ids=frozenset({END_ID}), record_trace=True)
    ids = [engine.add_request(p.tolist(), SamplingParams(max_tokens=new)) for p in batch]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def test_a_budget_that_never_evicts_reproduces_the_runners_own_output(model):
    batch = prompts()
    plain = runner(model)
    want = generated(plain.generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0), batch)
    vtoken = VTokenEngineRunner(runner(model), settings("streaming_llm", 1000), model.config.rope)
    got = generated(vtoken.generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0), batch)
    assert got == want and all(len(r) > 5 for r in got)
    stats = vtoken.stats()
    assert stats["tokens_evicted"] == 0 and stats["moves"] == 0 and stats["rerotation_passes"] == 0
    # Nothing was evicted, so nothing was freed: at a block boundary the session's block for the
    # next token stays where it is (it is not released and allocated again).
    assert stats["blocks_freed"] == 0
    # The session gave every sequence the longest prompt's 6 blocks; prompts of 5 and 13 tokens
    # keep 2 and 4 (their tokens and the next token's slot): 4 + 2 surplus blocks went back.
    assert stats["blocks_trimmed"] == 6


@pytest.mark.parametrize("policy", ["streaming_llm", "sliding_window", "random"])
def test_evicting_engine_path_decodes_as_the_keep_mode_reference(model, policy):
    batch, budget = prompts(), 10
    vtoken = VTokenEngineRunner(runner(model), settings(policy, budget), model.config.rope)
    session = vtoken.runner.session
    got = generated(vtoken.generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0), batch)
    reference = keep_mode_reference(model, policy, budget, batch)
    assert got == [r.output_ids[: len(got[i])] for i, r in enumerate(reference)]
    for step, logits in enumerate(session.generation_logits):
        for b, request in enumerate(reference):
            if step < len(request.logits):
                torch.testing.assert_close(logits[b], request.logits[step], rtol=1e-5, atol=1e-4)
    stats = vtoken.stats()
    assert stats["tokens_evicted"] > 0 and stats["blocks_freed"] > 0 and stats["rerotation_passes"] > 0


def test_each_step_binds_physical_offsets_and_lengths(model):
    """Offsets, lengths and block lists are rewritten as the engine's next step reads them, and
    every compaction that shortens a sequence re-rotates its keys exactly once."""
    batch = prompts()
    vtoken = VTokenEngineRunner(runner(model), settings("streaming_llm", 9), model.config.rope)
    session = vtoken.runner.session
    checks, passes = [], []
    original_run = EngineVToken.run

    def checked_run(self, pools_manager, written, window, stream=None):
        step = self.step
        before = {b: (step.kv_len(b) if b in step else 0) + written[b] for b in range(len(written))}
        calls = []
        shift = self.rerotation.shift_requests
        self.rerotation.shift_requests = lambda core, removed, *rest: calls.append(dict(removed)) or \
            shift(core, removed, *rest)
        lengths = original_run(self, pools_manager, written, window, stream)
        self.rerotation.shift_requests = shift
        manager = pools_manager.get_single_kv_cache_manager()
        # One re-rotation pass per step, covering exactly the sequences whose physical length fell.
        shrunk = {b: before[b] - step.kv_len(b) for b in before if before[b] > step.kv_len(b)}
        assert len(calls) == (1 if shrunk else 0) and (not shrunk or {b: d for b, d in calls[0].items() if d} == shrunk)
        passes.append(len(shrunk))
        rows = []
        for b, seq in enumerate(manager.sequences):
            held = [block.idx for block in manager.blocks_manager.allocated_blocks[seq][0]]
            assert held[: step.num_blocks(b)] == step.block_ids(b) and len(held) == step.kv_len(b) // TPB + 1
            assert step.kv_len(b) + 1 <= len(held) * TPB  # the next token's slot exists
            assert manager.lens[b] == step.kv_len(b) + 1 == lengths[b] + 1
            rows.append((held, step.kv_len(b)))
        checks.append(rows)
        return lengths

    EngineVToken.run = checked_run
    try:
        got = generated(vtoken.generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0), batch)
    finally:
        EngineVToken.run = original_run
    assert len(checks) == len(session.bound_history) > 10 and sum(passes) > 0
    for step, (bound, rows) in enumerate(zip(session.bound_history, checks)):
        for b, (blocks, kv_len) in enumerate(rows):
            encoded = torch.from_numpy(offsets.encode(blocks, layers_in_pool=2))
            assert torch.equal(bound["kv_cache_block_offsets"][0, b, :, : len(blocks)], encoded)
            assert torch.equal(bound["host_kv_cache_block_offsets"][0, b, :, : len(blocks)], encoded)
            assert int(bound["sequence_length"][b]) == kv_len + 1
            assert int(bound["host_past_key_value_lengths"][b]) == kv_len <= 9
    # The decoder kept its logical lengths (outputs are written there), not the physical ones.
    logical = [len(p) + len(g) + (len(g) < NEW) for p, g in zip(batch, got)]  # + the end token, if any
    assert session.sequence_length_buffer.tolist() == logical


def test_pool_is_sized_for_the_budget_and_generation_runs_past_max_seq_len(model):
    """A batch twice as large fits the plain session's pool, and runs past the engine's max_seq_len."""
    batch, budget, new = prompts() * 2, 12, 30
    engine_max = 40  # prompts of up to 22 tokens + 30 new ones do not fit
    with pytest.raises(RuntimeError, match="exceeds the engine"):
        runner(model, max_seq_len=engine_max).generate(batch, max_new_tokens=new, end_id=END_ID, pad_id=0)
    plain = runner(model, max_seq_len=64)
    plain.generate(batch[:3], max_new_tokens=new, end_id=END_ID, pad_id=0)
    plain_blocks = plain.session._memory_pool_allocator._pool_pointers[0].shape[0]
    vtoken = VTokenEngineRunner(runner(model, max_seq_len=engine_max), settings("sliding_window", budget),
                                model.config.rope)
    got = generated(vtoken.generate(batch, max_new_tokens=new, end_id=END_ID, pad_id=0), batch)
    reference = keep_mode_reference(model, "sliding_window", budget, batch, new)
    assert got == [r.output_ids[: len(got[i])] for i, r in enumerate(reference)]
    session = vtoken.runner.session
    bound = physical_bound(vtoken.settings, 22, new)
    assert bound == 22 and session.max_attention_window_size == bound
    num_blocks = session._memory_pool_allocator._pool_pointers[0].shape[0]
    assert num_blocks == 6 * -(-bound // TPB) <= plain_blocks == 3 * -(-(22 + new) // TPB)
    assert vtoken.runner.max_seq_len == engine_max  # restored
    assert max(int(h["host_past_key_value_lengths"].max()) for h in session.bound_history) <= budget


def test_without_rerotation_the_engine_path_diverges(model):
    """The keep-mode agreement above can fail: the plugin's physical positions alone are wrong."""
    batch = prompts()
    vtoken = VTokenEngineRunner(runner(model), settings("streaming_llm", 8), model.config.rope)
    original = EngineVToken.__init__

    def no_rerotation(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.rerotation.shift_requests = lambda *args: 0

    EngineVToken.__init__ = no_rerotation
    try:
        vtoken.generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0)
    finally:
        EngineVToken.__init__ = original
    reference = keep_mode_reference(model, "streaming_llm", 8, batch)
    worst = max(float((logits[b] - request.logits[step]).abs().max())
                for step, logits in enumerate(vtoken.runner.session.generation_logits)
                for b, request in enumerate(reference) if step < len(request.logits))
    assert worst > 1e-2


def test_refusals_are_clear(model):
    with pytest.raises(ValueError, match="attention probabilities"):
        check_engine_settings(settings("h2o", 8))
    with pytest.raises(ValueError, match="attention probabilities"):
        VTokenEngineRunner(runner(model), settings("scissorhands", 8), model.config.rope)
    with pytest.raises(ValueError, match="positions='shift'"):
        check_engine_settings(settings("streaming_llm", 8, positions="keep"))
    with pytest.raises(ValueError, match="'dense' only"):
        VTokenSettings(policy="random", mode="lazy", positions="shift")
    vtoken = VTokenEngineRunner(runner(model, max_seq_len=40), settings("random", 0.9), model.config.rope)
    with pytest.raises(ValueError, match="more than the engine's max_seq_len 40"):
        vtoken.generate(prompts(), max_new_tokens=30, end_id=END_ID, pad_id=0)


def test_the_runner_wraps_a_session_once_and_takes_new_settings(model):
    plain = runner(model)
    first = VTokenEngineRunner(plain, settings("random", 1000), model.config.rope)
    second = VTokenEngineRunner(plain, settings("streaming_llm", 9), model.config.rope)
    assert type(plain.session).__mro__[1] is GenerationSessionDouble12  # one vToken layer, not two
    second.generate(prompts(), max_new_tokens=8, end_id=END_ID, pad_id=0)
    assert first.stats() == second.stats() and second.stats()["tokens_evicted"] > 0


def test_engine_rope_reads_the_engine_config(tmp_path):
    from trtllm_vtoken.integration.trtllm.engine_runner import engine_rope

    (tmp_path / "config.json").write_text(
        '{"pretrained_config": {"architecture": "LlamaForCausalLM", "hidden_size": 64, "num_attention_heads": 4, '
        '"head_size": 16, "position_embedding_type": "rope_gpt_neox", "rotary_base": 10000.0, "rotary_scaling": null}}')
    assert engine_rope(tmp_path) == LlamaConfig.tiny().rope


def test_example_without_tensorrt_llm_says_what_it_needs():
    example = Path(__file__).resolve().parents[2] / "examples" / "trtllm" / "run_engine.py"
    assert subprocess.run([sys.executable, str(example), "--help"], capture_output=True).returncode == 0
    result = subprocess.run([sys.executable, str(example), "/tmp/engine", "--tokenizer", "/tmp/tok"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "tensorrt_llm 1.2" in result.stderr
