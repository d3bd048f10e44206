# SPDX-License-Identifier: Apache-2.0
"""What vToken reads from a ``trtllm-build`` engine's ``config.json``, and the engines it refuses.

    config.json
      pretrained_config
        position_embedding_type, rotary_base, rotary_scaling, head_size, rotary_pct / rotary_dim
                                        -> the RoPE the re-rotation pass applies (``RopeSpec``)
        quantization.kv_cache_quant_algo "INT8" / "FP8" -> refused: the KV pool holds 8-bit codes
                                        with one scale per tensor; rotating a code is not rotating
                                        the key, and every pass would requantize
      build_config.plugin_config.streamingllm
                                        -> refused: the GPT attention plugin's position-shift mode
                                        (``pos_shift_enabled``, set from this flag in
                                        ``functional.py`` ``gpt_attention``) caches keys WITHOUT
                                        RoPE (``applyBiasRopeUpdateKVCache``: ``k_to_cache =
                                        POS_SHIFT ? k_wo_pos : k``) and rotates each cached key by
                                        its slot in the cache when it reads it (``shiftKCache``,
                                        ``token_pos_idx``); a re-rotation pass would rotate twice,
                                        and without one the positions are the cache slots, which
                                        dense compaction reorders (it moves the newest tokens into
                                        the holes). TensorRT-LLM 1.1 on refuses to build such an
                                        engine anyway (``commands/build.py`` ``build_model``:
                                        "StreamingLLM is no longer supported", PR #6379).

        pretrained_config.num_medusa_heads / max_draft_len (Medusa, EAGLE, lookahead, external
                                        drafts), redrafter_num_beams (ReDrafter)
                                        -> refused: ``ModelRunner`` (``runtime/model_runner.py``)
                                        hands them to ``GenerationSession``, which then writes
                                        several draft tokens per step and copies the logical
                                        lengths into ``host_past_key_value_lengths`` after
                                        vToken's hook (``process_logits_including_draft``); the
                                        runner assumes one written token per step
        pretrained_config.rope_local_base_freq (Gemma-3)
                                        -> refused: the local (sliding-window) layers rotate with
                                        their own base, and ``RopeSpec`` knows one frequency table

A pool whose dtype is 8-bit is refused by the runner too (``check_pool``), whatever the config says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trtllm_vtoken.reclaim.rope import RopeSpec

QUANTIZED_KV_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def read_engine_config(engine_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(engine_dir) / "config.json").read_text())


def engine_problems(config: Mapping[str, Any]) -> list[str]:
    """Why vToken cannot run on the engine with this ``config.json`` (empty if it can)."""
    problems = []
    pretrained = config.get("pretrained_config") or {}
    quant = (pretrained.get("quantization") or {}).get("kv_cache_quant_algo")
    if quant:
        problems.append(f"its KV cache is quantized (kv_cache_quant_algo {quant!r}): re-rotating 8-bit codes "
                        "with a per-tensor scale would corrupt the keys; build without KV-cache quantization")
    plugin = ((config.get("build_config") or {}).get("plugin_config") or {})
    if plugin.get("streamingllm"):
        problems.append("it was built with StreamingLLM (plugin_config.streamingllm): the GPT attention plugin "
                        "then caches keys without RoPE and rotates each by its cache slot when reading it, so a "
                        "re-rotation would rotate twice, and without one vToken's compaction (which reorders "
                        "the cache) would change every position; build without --streamingllm")
    drafts = {k: pretrained.get(k) for k in ("num_medusa_heads", "max_draft_len", "redrafter_num_beams")
              if pretrained.get(k)}
    if drafts:
        problems.append(f"it drafts tokens ({', '.join(f'{k} {v}' for k, v in drafts.items())}: a "
                        "speculative-decoding engine): the generation session writes several draft tokens per "
                        "step and sets the KV lengths after vToken's hook, which assumes one written token per "
                        "step; build the base model without draft heads")
    if pretrained.get("rope_local_base_freq") is not None:
        problems.append(f"its local attention layers rotate with their own base (rope_local_base_freq "
                        f"{pretrained['rope_local_base_freq']!r}, Gemma-3) and vToken's re-rotation knows one "
                        "RoPE table (rotary_base); use the PyTorch backend, which keeps positions")
    return problems


def check_engine_config(config: Mapping[str, Any]) -> None:
    problems = engine_problems(config)
    if problems:
        raise ValueError("vToken cannot run on this engine: " + "; ".join(problems))


def engine_rope(engine_dir: str | Path) -> RopeSpec:
    """The RoPE of a trtllm-build engine, from its ``config.json`` (``pretrained_config``).
    ValueError if the engine is refused (``engine_problems``) or its positions cannot be shifted
    (``rope.check_shiftable``)."""
    config = read_engine_config(engine_dir)
    check_engine_config(config)
    return RopeSpec.from_trtllm_config(config["pretrained_config"])


def check_pool(pool: torch.Tensor) -> None:
    """ValueError for a quantized KV pool (int8 / fp8 codes): keys cannot be re-rotated there."""
    if pool.dtype in QUANTIZED_KV_DTYPES:
        raise ValueError(f"the KV pool holds {pool.dtype} codes (KV-cache quantization): re-rotating quantized "
                         "keys corrupts them; vToken's engine path needs a float16, bfloat16 or float32 KV cache")
