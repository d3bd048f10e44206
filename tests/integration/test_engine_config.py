# SPDX-License-Identifier: Apache-2.0
"""The engines vToken's engine path refuses, read from a ``trtllm-build`` ``config.json`` (its
fields as an engine built by TensorRT-LLM writes them: ``pretrained_config.quantization``,
``build_config.plugin_config``) and from the KV pool the session allocates."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_engine_runner import END_ID, TPB, prompts, settings
from tests.integration.trtllm_session_double12 import GenerationSessionDouble12, ModelRunnerDouble12
from trtllm_vtoken.integration.trtllm.engine_config import check_pool, engine_problems, engine_rope
from trtllm_vtoken.integration.trtllm.engine_runner import EngineVToken, VTokenEngineRunner
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM

PRETRAINED = {"architecture": "LlamaForCausalLM", "hidden_size": 64, "num_attention_heads": 4, "head_size": 16,
              "position_embedding_type": "rope_gpt_neox", "rotary_base": 10000.0, "rotary_scaling": None,
              "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128}}
BUILD = {"plugin_config": {"paged_kv_cache": True, "tokens_per_block": 64, "streamingllm": False}}


def engine_dir(tmp_path, quant=None, streamingllm=False, **extra):
    pretrained = {**PRETRAINED, "quantization": {**PRETRAINED["quantization"], "kv_cache_quant_algo": quant}, **extra}
    build = {"plugin_config": {**BUILD["plugin_config"], "streamingllm": streamingllm}}
    (tmp_path / "config.json").write_text(json.dumps({"version": "1.2.1", "pretrained_config": pretrained,
                                                      "build_config": build}))
    return tmp_path


def test_a_plain_engine_is_accepted(tmp_path):
    assert engine_problems(json.loads((engine_dir(tmp_path) / "config.json").read_text())) == []
    assert engine_rope(engine_dir(tmp_path)) == LlamaConfig.tiny().rope


@pytest.mark.parametrize("quant", ["FP8", "INT8"])
def test_kv_cache_quantization_is_refused(tmp_path, quant):
    with pytest.raises(ValueError, match=f"KV cache is quantized \\(kv_cache_quant_algo '{quant}'\\)"):
        engine_rope(engine_dir(tmp_path, quant=quant))


def test_a_streamingllm_engine_is_refused(tmp_path):
    """Position-shift mode caches unrotated keys and rotates them by cache slot at read time."""
    with pytest.raises(ValueError, match=r"built with StreamingLLM .* re-rotation would rotate twice"):
        engine_rope(engine_dir(tmp_path, streamingllm=True))


@pytest.mark.parametrize("extra", [{"num_medusa_heads": 4, "max_draft_len": 63},
                                   {"redrafter_num_beams": 5, "redrafter_draft_len_per_beam": 5}])
def test_draft_engines_are_refused(tmp_path, extra):
    """``ModelRunner`` reads these pretrained_config fields (``runtime/model_runner.py``) and turns
    the generation session's Medusa / ReDrafter paths on; a plain engine has none of them."""
    with pytest.raises(ValueError, match=r"it drafts tokens \((num_medusa_heads 4|redrafter_num_beams 5)"):
        engine_rope(engine_dir(tmp_path, **extra))
    assert engine_problems({"pretrained_config": {**PRETRAINED, "num_medusa_heads": 0, "max_draft_len": 0}}) == []


def test_a_gemma3_engine_is_refused(tmp_path):
    """Gemma-3's local layers rotate with ``rope_local_base_freq``; vToken's re-rotation knows one base."""
    with pytest.raises(ValueError, match=r"rope_local_base_freq 10000.0, Gemma-3"):
        engine_rope(engine_dir(tmp_path, rope_local_base_freq=10000.0))


def test_a_quantized_pool_is_refused_whatever_the_config_says():
    """The session allocates an int8 pool for a quantized KV cache (fp8 too: torch had no fp8)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    session = GenerationSessionDouble12(model, TPB, kv_cache_quant=True)
    runner = ModelRunnerDouble12(session, max_batch_size=6, max_input_len=32, max_seq_len=64)
    vtoken = VTokenEngineRunner(runner, settings("streaming_llm", 10), model.config.rope)
    with pytest.raises(ValueError, match=r"KV pool holds torch.int8 codes \(KV-cache quantization\)"):
        vtoken.generate(prompts(), max_new_tokens=4, end_id=END_ID, pad_id=0)
    for dtype in (torch.float8_e4m3fn, torch.uint8):
        with pytest.raises(ValueError, match="re-rotating quantized keys corrupts them"):
            check_pool(torch.zeros(1, 1, 2, 1, 4, 8, dtype=dtype))
    check_pool(torch.zeros(1, 1, 2, 1, 4, 8, dtype=torch.bfloat16))


def shift_engine_runner(model) -> ModelRunnerDouble12:
    session = GenerationSessionDouble12(model, TPB, position_shift=True)
    return ModelRunnerDouble12(session, max_batch_size=6, max_input_len=32, max_seq_len=64)


def test_why_streamingllm_engines_are_refused():
    """Over the position-shift engine double: without compaction it decodes exactly as a plain
    engine (keys rotated by slot = by position). With vToken's compaction, re-rotating turns keys the
    plugin turns again by their slot, and not re-rotating leaves each key at its cache slot, which
    dense compaction reorders (the newest tokens move into the holes): neither decodes as the
    keep-mode reference, which vToken on a plain engine matches (test_engine_runner.py)."""
    from tests.integration.test_engine_runner import NEW, generated, keep_mode_reference, runner

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    batch = prompts()
    plain = runner(model).generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0)
    shifted = shift_engine_runner(model)
    assert generated(shifted.generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0), batch) == \
        generated(plain, batch)
    reference = keep_mode_reference(model, "streaming_llm", 8, batch)
    for rerotate in (True, False):
        vtoken = VTokenEngineRunner(shift_engine_runner(model), settings("streaming_llm", 8), model.config.rope)
        original = EngineVToken.__init__

        def maybe_without_rerotation(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if not rerotate:
                self.rerotation.shift_requests = lambda *args: 0

        EngineVToken.__init__ = maybe_without_rerotation
        try:
            vtoken.generate(batch, max_new_tokens=NEW, end_id=END_ID, pad_id=0)
        finally:
            EngineVToken.__init__ = original
        assert vtoken.stats()["moves"] > 0
        worst = max(float((logits[b] - request.logits[step]).abs().max())
                    for step, logits in enumerate(vtoken.runner.session.generation_logits)
                    for b, request in enumerate(reference) if step < len(request.logits))
        assert worst > 1e-2, (rerotate, worst)
