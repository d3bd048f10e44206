# SPDX-License-Identifier: Apache-2.0
"""The engine's mass: one forward's handed over as it is, several forwards' staged in one array
(one copy per forward, one view per batch size, zero past each row); on the tiny model H2O's call
repeats and the engine computes what it computes at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.test_engine import LONG, config, prompts
from trtllm_vtoken.bench.step_config import StepBenchConfig
from trtllm_vtoken.bench.step_mass import buffer_mass
from trtllm_vtoken.core import native
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.mass_staging import MassStaging
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel, SyntheticAttention


def test_one_array_one_copy_per_forward_and_each_rows_tail_cleared():
    staging = MassStaging(3, 8)
    decode = torch.tensor([[1.0, 2, 3, 4, 5], [1, 1, 1, 0, 0]])  # one forward's two rows
    first = staging.stage([decode])
    assert first.dtype == np.float32 and first.shape == (2, 8) and first.flags.c_contiguous
    assert first.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    again = staging.stage([torch.full((1, 2), 7.0), torch.full((1, 4), 2.0)])  # two forwards, row 0 narrower
    assert again is first
    assert again.tolist() == [[7, 7, 0, 0, 0, 0, 0, 0], [2, 2, 2, 2, 0, 0, 0, 0]]
    one = staging.stage([torch.ones(1, 1)])  # a batch of one: the first row, its tail cleared
    assert one is not first and one.tolist() == [[1, 0, 0, 0, 0, 0, 0, 0]] and first[0].tolist() == one[0].tolist()
    assert staging.stage([torch.ones(1, 1)]) is one
    three = staging.stage([torch.ones(2, 8), torch.ones(1, 3)])
    assert three.tolist() == [[1] * 8, [1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="9 positions is wider than the staging width 8"):
        staging.stage([torch.ones(1, 1), torch.ones(1, 9)])
    with pytest.raises(ValueError, match="4 mass rows, the staging holds 3"):
        staging.stage([torch.ones(4, 1)])
    assert three.tolist()[0] == [1] * 8  # nothing rewritten
    with pytest.raises(ValueError, match="must be positive"):
        MassStaging(2, 0)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_engines_mass_repeats_h2o_and_computes_what_it_computes_at_once(prefix_caching):
    """Beside sampling, the C++ core's call repeats for H2O (the decode forward's array each
    step, staged where a prefill joins the batch) in most steps; every step's logits, the outputs
    and each request's evictions equal the engine's with the call made at once (never repeated)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    results = {}
    for overlap in (False, True):
        engine = Engine(model, config(step_impl="cpp", step_overlap=overlap, check_invariants=False,
                                      prefix_caching=prefix_caching), record_trace=True)
        ids = [engine.add_request(p, LONG) for p in prompts(6)]
        traces = {}
        while engine.has_unfinished():
            engine.step()
            for r in ids:
                traces[r] = [t.clone() for t in engine.requests[r].logits]
        outs = [engine.pop_finished(r) for r in ids]
        results[overlap] = (engine.kv.step_stats, traces, [(o.output_ids, o.evictions) for o in outs])
    at_once, beside = results[False], results[True]
    assert at_once[0].repeated_steps == 0 and beside[0].repeated_steps >= beside[0].steps // 2
    assert beside[0].tokens_evicted == at_once[0].tokens_evicted > 0
    assert beside[2] == at_once[2]
    for r, logits in at_once[1].items():
        assert len(beside[1][r]) == len(logits) and all(torch.equal(a, b) for a, b in zip(logits, beside[1][r]))


@pytest.mark.parametrize("step_impl", ["python", "cpp"])
def test_the_simulated_backends_forward_tensor_is_handed_over_as_the_models(step_impl):
    """A simulated forward's mass as a torch tensor (``vtoken bench step --mass forward``) reaches
    the step as the model's one forward does: a numpy view of the tensor, a new array object each
    step, no copy. With the C++ core beside sampling the call repeats on it as on one host array
    handed over every step (``--mass buffer``), and every request evicts the same tokens."""
    if step_impl == "cpp" and native.load() is None:
        pytest.skip("the C++ core is not built")
    cfg = StepBenchConfig(batches=(4,), context=96, tokens_per_block=8, steps=6, warmup=0, repeats=1)
    row = dict(variant="vtoken", mode="dense", policy="h2o", impl=step_impl)
    width = -(-cfg.max_seq_len() // cfg.tokens_per_block) * cfg.tokens_per_block
    runs = {}
    for tensor in (False, True):
        model = SimulatedModel(MODEL_SHAPES["llama-3.1-8b"], SyntheticAttention(0), np.float32)
        model.batch_mass = buffer_mass(cfg.seed, width, tensor=tensor)
        engine = Engine(model, cfg.engine_config(4, row), record_trace=True)
        seen = []
        start_step = engine.kv.start_step

        def watched(req_ids, mass=None, start_step=start_step, seen=seen, **options):
            seen.append(mass)
            return start_step(req_ids, mass, **options)

        engine.kv.start_step = watched
        ids = [engine.add_request([1] * (cfg.context - 3 * i), SamplingParams(max_tokens=8, ignore_eos=True))
               for i in range(4)]
        while engine.has_unfinished():
            engine.step()
        runs[tensor] = (engine, seen, [engine.pop_finished(r).evictions for r in ids], model.batch_mass(ids, [1] * 4))
    (as_array, handed, evictions, array), (forward, forward_seen, forward_evictions, tensor) = runs[False], runs[True]
    decode = [m for m in forward_seen if m is not None and len(m) == 4]
    assert len(decode) >= 6 and len({id(m) for m in decode}) == len(decode)  # a new array each step
    assert all(isinstance(m, np.ndarray) and np.shares_memory(m, tensor.numpy()) for m in decode)  # no copy
    assert all(m is array for m in handed if m is not None and len(m) == 4)  # the host array, as it is
    assert sum(len(v) for steps in forward_evictions for v in steps) > 0 and forward_evictions == evictions
    assert forward.kv.step_stats.tokens_evicted == as_array.kv.step_stats.tokens_evicted
    if step_impl == "cpp":
        assert forward.kv.step_stats.repeated_steps == as_array.kv.step_stats.repeated_steps > 0
