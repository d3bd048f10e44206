# SPDX-License-Identifier: Apache-2.0
"""The engine's staged mass: one array, one copy per forward, one view per batch size, zero past
each row; on the tiny model H2O's call then repeats and the engine computes what it computes at
once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.test_engine import LONG, config, prompts, run
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.mass_staging import MassStaging
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM


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
def test_the_engines_staged_mass_repeats_h2o_and_computes_what_it_computes_at_once(prefix_caching):
    """Beside sampling, the C++ core's call repeats for H2O (the same staged array every step)
    in most steps; every step's logits, the outputs and each request's evictions equal the
    engine's with the call made at once (never repeated)."""
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
