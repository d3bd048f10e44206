# SPDX-License-Identifier: Apache-2.0
"""The prompt forms ``LLM.generate`` accepts, as ``tensorrt_llm.LLM.generate`` does
(``tensorrt_llm/llmapi/llm.py`` ``BaseLLM.generate``, ``tensorrt_llm/inputs/data.py``
``prompt_inputs``):

    "text"                                     one prompt     -> one RequestOutput
    [1, 2, 3]                                  one prompt, token ids (a list starting with an int)
    {"prompt": "text"} / {"prompt_token_ids": [1, 2, 3]}      one prompt
    ["text", [1, 2], {"prompt": "t"}, ...]     a batch        -> a list of RequestOutput

A tuple is read as a list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FORMS = ("a str, a list of int (one prompt's token ids), {'prompt': str}, {'prompt_token_ids': [int, ...]}, "
         "or a list of these")


@dataclass(frozen=True)
class Prompt:
    text: str | None
    """The prompt as given, if text (``RequestOutput.prompt``)."""
    token_ids: list[int] | None
    """The prompt as given, if token ids."""


def parse_prompts(inputs: Any) -> tuple[list[Prompt], bool]:
    """(the prompts, whether ``inputs`` was a batch). Raises TypeError for another form and
    ValueError for an empty batch or prompt."""
    if isinstance(inputs, (str, dict)) or (_is_sequence(inputs) and inputs and _is_int(inputs[0])):
        return [_one(inputs)], False
    if not _is_sequence(inputs):
        raise TypeError(f"prompts must be {FORMS}; got {type(inputs).__name__}")
    if not inputs:
        raise ValueError("no prompts given")
    return [_one(item) for item in inputs], True


def _one(item: Any) -> Prompt:
    if isinstance(item, str):
        if not item:
            raise ValueError("a prompt is empty")
        return Prompt(item, None)
    if isinstance(item, dict):
        key, value = next(iter(item.items())) if len(item) == 1 else (None, None)
        if key == "prompt" and isinstance(value, str) or key == "prompt_token_ids" and not isinstance(value, str):
            return _one(value)
        raise TypeError(f"a prompt dict holds a str 'prompt' or a list 'prompt_token_ids' alone, got {item!r:.60}")
    if _is_sequence(item) and all(_is_int(t) for t in item):
        if not item:
            raise ValueError("a prompt is empty")
        return Prompt(None, [int(t) for t in item])
    raise TypeError(f"each prompt must be a str, a list of int or a prompt dict; got {item!r:.60}")


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
