# SPDX-License-Identifier: Apache-2.0
"""Text <-> token ids for the engine: the model folder's Hugging Face tokenizer, its chat
template, its end-of-sequence ids, and incremental detokenization for streaming."""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy: imported on first use

        folder = Path(folder)
        self._tok = AutoTokenizer.from_pretrained(str(folder))
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = folder / name
            if path.is_file():
                value = json.loads(path.read_text()).get("eos_token_id")
                eos.update([value] if isinstance(value, int) else value or [])
        if self._tok.eos_token_id is not None:
            eos.add(self._tok.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``; with ``chat``, wrapped as one user turn of the chat template,
        ending with the assistant's generation prompt."""
        if chat and self.has_chat_template:
            ids = self._tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class StreamText:
    """Turns a growing list of output ids into text pieces, cutting at stop strings.

    Decodes the whole output each time (tokens can merge across boundaries), withholds a trailing
    U+FFFD (an incomplete UTF-8 character) and the last ``longest stop - 1`` characters (which may
    be the start of a stop string), so pieces never need to be taken back.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def update(self, output_ids: list[int], final: bool) -> tuple[str, str | None]:
        """Returns (new text to emit, the stop string found or None)."""
        text = self.tokenizer.decode(output_ids)
        hit = None
        if self.stop:
            start = max(0, self.emitted - self.hold)
            found = [(i, s) for s in self.stop for i in [text.find(s, start)] if i >= 0]
            if found:
                cut, hit = min(found)
                text, final = text[:cut], True
        self.text = text
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd")) - self.hold
        if end <= self.emitted:
            return "", hit
        piece, self.emitted = text[self.emitted : end], end
        return piece, hit
