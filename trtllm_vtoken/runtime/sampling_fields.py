# SPDX-License-Identifier: Apache-2.0
"""TensorRT-LLM 1.2.1's ``SamplingParams`` fields that the reference runtime does not implement,
and how ``SamplingParams(...)`` treats a keyword.

    keyword                          SamplingParams(...)
    one of ours (max_tokens, ...)    taken
    one of NOT_IMPLEMENTED           accepted at TensorRT-LLM's default (ignored), else ValueError
    anything else                    TypeError naming the nearest known field

so ``SamplingParams(max_tokens=8, n=1, detokenize=True)``, written for TensorRT-LLM, runs here,
``use_beam_search=True`` says plainly that it cannot, and ``max_token=8`` gets "did you mean
'max_tokens'?". Names and defaults: ``tensorrt_llm/sampling_params.py`` ``SamplingParams`` of
the 1.2 line (the copy with ``params_imply_greedy_decoding``); the test double
``tests/integration/trtllm121/tensorrt_llm/sampling_params.py`` carries them with its citation,
and a test holds this table and our fields' defaults to it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from trtllm_vtoken.config_base import did_you_mean

NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    # name: accepted values, TensorRT-LLM's default first
    "end_id": (None,), "pad_id": (None,), "bad": (None,), "bad_token_ids": (None,),
    "include_stop_str_in_output": (False,), "embedding_bias": (None,), "logits_processor": (None,),
    "apply_batched_logits_processor": (False,),
    "n": (1,), "best_of": (None, 1), "use_beam_search": (False,),  # one sequence per request
    "top_p_min": (None,), "top_p_reset_ids": (None,), "top_p_decay": (None,), "min_tokens": (None,),
    "beam_search_diversity_rate": (None,), "repetition_penalty": (None,), "length_penalty": (None,),
    "early_stopping": (None,), "no_repeat_ngram_size": (None,), "min_p": (None,), "beam_width_array": (None,),
    "prompt_logprobs": (None,), "return_context_logits": (False,), "return_generation_logits": (False,),
    "exclude_input_from_output": (True,), "return_encoder_output": (False,), "return_perf_metrics": (False,),
    "additional_model_outputs": (None,), "lookahead_config": (None,), "guided_decoding": (None,),
    "detokenize": (True,), "add_special_tokens": (True,), "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
}


def check_sampling_keywords(cls: type) -> None:
    """Wraps the dataclass ``cls``'s ``__init__`` (keyword-only) with the table above."""
    init = cls.__init__
    own = {f.name for f in dataclasses.fields(cls) if f.init}

    @functools.wraps(init)
    def checked_init(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - own - set(NOT_IMPLEMENTED))
        if unknown:
            raise TypeError(f"{cls.__name__} got unknown field(s) {unknown}"
                            f"{did_you_mean(unknown, own | set(NOT_IMPLEMENTED))}")
        for name in sorted(set(kwargs) & set(NOT_IMPLEMENTED)):
            value, accepted = kwargs.pop(name), NOT_IMPLEMENTED[name]
            if not any(value is a or (a is not None and value == a) for a in accepted):
                raise ValueError(f"{cls.__name__}({name}={value!r}): TensorRT-LLM's field is not implemented "
                                 f"by the reference runtime; leave it at {accepted[0]!r}")
        init(self, **kwargs)

    cls.__init__ = checked_init
