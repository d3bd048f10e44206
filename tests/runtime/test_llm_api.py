# SPDX-License-Identifier: Apache-2.0
"""``LLM`` as TensorRT-LLM's LLM API users call it: one user script runs against ours and against
the TensorRT-LLM 1.2.1 double (``tests/integration/trtllm121``) and both accept the same calls and
return the same shape; the prompt forms; ``SamplingParams`` against TensorRT-LLM's fields and
defaults; logprobs exactly as the model's logits give them; stream snapshots; the previous
release's names warn. A tiny random model with SmolLM2's tokenizer keeps it fast."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.integration.trtllm121.tensorrt_llm import sampling_params as trtllm_sampling_params
from tests.integration.trtllm121.tensorrt_llm.llmapi import llm as trtllm_llm
from trtllm_vtoken.deprecation import VTokenDeprecationWarning
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.llm import LLM
from trtllm_vtoken.runtime.model import load_llama
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.sampling_fields import NOT_IMPLEMENTED

ENGINE = dict(num_blocks=64, tokens_per_block=4, max_seq_len=128, policy="streaming_llm", budget=24)


@pytest.fixture(scope="module")
def llm(tiny_llm_folder):
    return LLM(tiny_llm_folder, threads=1, **ENGINE)


def user_script(llm, SamplingParams) -> list:
    """Code as a TensorRT-LLM user writes it; returns what it read from the results."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, n=1, detokenize=True)
    one = llm.generate("Hello, my name is", params)
    ids = llm.generate([11, 12, 13], params)  # one prompt, as token ids
    batch = llm.generate(["Hello", "The capital of France is"], sampling_params=params, use_tqdm=False)
    mixed = llm.generate([[21, 22], {"prompt": "Hi"}, {"prompt_token_ids": [23, 24, 25]}], [params] * 3)
    llm.shutdown()
    seen = []
    for result in [one, ids, *batch, *mixed]:
        out = result.outputs[0]
        seen.append({
            "request_id is int": isinstance(result.request_id, int),
            "prompt": result.prompt,
            "ids prompt": result.prompt_token_ids if result.prompt is None else "text",
            "finished": result.finished, "outputs": len(result.outputs), "index": out.index,
            "tokens": len(out.token_ids), "text is str": isinstance(out.text, str),
            "finish_reason": out.finish_reason,
            "logprobs": [sorted((type(lp.logprob).__name__, type(lp.rank).__name__) for lp in step.values())[:1]
                         for step in out.logprobs],
            "sampled in logprobs": all(t in step for t, step in zip(out.token_ids, out.logprobs)),
        })
    return [type(one).__name__, type(batch).__name__, len(batch), len(mixed), seen]


def test_one_user_script_runs_against_ours_and_tensorrt_llms_double(tiny_llm_folder):
    ours = user_script(LLM(tiny_llm_folder, threads=1, **ENGINE), SamplingParams)
    theirs = user_script(trtllm_llm.LLM("tiny"), trtllm_llm.SamplingParams)
    assert ours == theirs
    assert ours[:4] == ["RequestOutput", "list", 2, 3]
    assert [s["prompt"] for s in ours[4]] == ["Hello, my name is", None, "Hello", "The capital of France is",
                                              None, "Hi", None]
    assert [s["ids prompt"] for s in ours[4] if s["prompt"] is None] == [[11, 12, 13], [21, 22], [23, 24, 25]]
    assert all(s["finish_reason"] == "length" and s["tokens"] == 4 for s in ours[4])


def test_sampling_params_fields_and_defaults_are_tensorrt_llms():
    """Every field of ours but ``eviction`` is one of TensorRT-LLM 1.2.1's with its default; every
    other TensorRT-LLM field is in the not-implemented table with its default first."""
    theirs = {f.name: f.default for f in dataclasses.fields(trtllm_sampling_params.SamplingParams)}
    ours = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert set(ours) - set(theirs) == {"eviction"}
    assert {name: theirs[name] for name in ours if name != "eviction"} == {k: v for k, v in ours.items()
                                                                           if k != "eviction"}
    assert set(NOT_IMPLEMENTED) == set(theirs) - set(ours)
    assert {name: accepted[0] for name, accepted in NOT_IMPLEMENTED.items()} == \
        {name: theirs[name] for name in NOT_IMPLEMENTED}


@pytest.mark.parametrize("bad,error", [
    (12, TypeError), ([], ValueError), ([[1, 2], 3], TypeError), ({"prompt": "a", "x": 1}, TypeError),
    ([""], ValueError),
])
def test_prompt_forms_outside_tensorrt_llms_are_refused(llm, bad, error):
    with pytest.raises(error):
        llm.generate(bad, SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="takes one prompt"):
        next(llm.stream(["a", "b"], SamplingParams(max_tokens=2)))


def test_logprobs_are_the_top_k_and_the_sampled_token_of_the_models_distribution(llm, tiny_llm_folder):
    """Against the logits the engine sampled from (a trace of the same request on the same model):
    per token, the k most likely tokens with ranks 1..k and the sampled one with its own rank."""
    k, prompt = 2, [5, 9, 17, 33]  # sampled at a high temperature: often outside the top k
    params = SamplingParams(max_tokens=12, temperature=4.0, seed=7, ignore_eos=True, logprobs=k)
    got = llm.generate(prompt, params).outputs[0]
    engine = Engine(load_llama(tiny_llm_folder), llm.config, llm.tokenizer, record_trace=True)
    request = engine.requests[engine.add_request(prompt, params)]
    while engine.has_unfinished():
        engine.step()
    assert got.token_ids == request.output_ids
    outside = 0
    for token, logits, entry in zip(got.token_ids, request.logits, got.logprobs, strict=True):
        logprobs = torch.log_softmax(logits.float(), -1)
        order = torch.sort(logprobs, descending=True, stable=True).indices.tolist()
        expected = {t: (float(logprobs[t]), rank) for rank, t in enumerate(order[:k], start=1)}
        if token not in expected:
            outside += 1
            expected[token] = (float(logprobs[token]), order.index(token) + 1)
        assert {t: (lp.logprob, lp.rank) for t, lp in entry.items()} == expected
        assert list(entry)[:k] == order[:k]  # most likely first
    assert outside > 0  # the sampled token's own entry was exercised
    assert got.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(got.token_ids, got.logprobs)))
    assert llm.generate(prompt, SamplingParams(max_tokens=3)).outputs[0].logprobs == []


def test_stream_snapshots_grow_to_the_generated_output(llm):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    whole = llm.generate("Tell me a story.", params)
    snapshots = list(llm.stream("Tell me a story.", params))
    assert [s.finished for s in snapshots] == [False] * (len(snapshots) - 1) + [True]
    assert sum((s.outputs[0].token_ids_diff for s in snapshots), []) == whole.outputs[0].token_ids
    assert "".join(s.outputs[0].text_diff for s in snapshots) == whole.outputs[0].text
    assert sum((s.outputs[0].logprobs_diff for s in snapshots), []) == whole.outputs[0].logprobs
    assert (snapshots[-1].prompt, snapshots[-1].prompt_token_ids) == (whole.prompt, whole.prompt_token_ids)


def test_the_previous_releases_names_still_work_and_warn(llm):
    with pytest.warns(VTokenDeprecationWarning, match=r"unpacking one prompt's result"):
        [out] = llm.generate([3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    completion = out.outputs[0]
    for old, value in [("req_id", out.request_id), ("text", completion.text), ("token_ids", completion.token_ids),
                       ("finish_reason", completion.finish_reason)]:
        with pytest.warns(VTokenDeprecationWarning, match=rf"RequestOutput\.{old} is deprecated"):
            assert getattr(out, old) == value
    with pytest.warns(VTokenDeprecationWarning, match="the keyword params= is deprecated.*use sampling_params="):
        again = llm.generate([3, 4, 5], params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert again.outputs[0].token_ids == completion.token_ids
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.generate([3, 4, 5], sampling_param=SamplingParams())


def test_llm_sets_the_threads_it_is_given(tiny_llm_folder):
    LLM(tiny_llm_folder, threads=2, **ENGINE)
    assert torch.get_num_threads() == 2
