# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/inputs/data.py`` ``prompt_inputs`` (1.2-era copy, index id
36333897439: the one whose ``TextPrompt`` carries ``multi_modal_uuids``).

What it imitates: ``PromptInputs = Union[str, List[int], TextPrompt, TokensPrompt]``; a str
becomes ``{"prompt": str}``, a list (whose first item must be an int; the real code asserts it)
``{"prompt_token_ids": list}``, a dict passes if it holds ``prompt`` or ``prompt_token_ids``;
anything else is a TypeError.
"""

from __future__ import annotations

from typing import Any


def prompt_inputs(inputs: Any) -> dict:
    if isinstance(inputs, str):
        return {"prompt": inputs}
    if isinstance(inputs, list):
        assert isinstance(inputs[0], int)
        return {"prompt_token_ids": inputs}
    if isinstance(inputs, dict):
        assert inputs.get("prompt") is not None or inputs.get("prompt_token_ids") is not None
        return inputs
    raise TypeError(f"prompt inputs of type {type(inputs)} are not accepted by llm.generate")
