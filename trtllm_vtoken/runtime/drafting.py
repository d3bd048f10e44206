# SPDX-License-Identifier: Apache-2.0
"""N-gram (prompt-lookup) drafting: draft tokens for speculative decoding without a draft model,
as TensorRT-LLM's ``NGram`` mode and vLLM's ``[ngram]`` propose them.

The request's newest ``n`` tokens (its pending token last) are looked up among its earlier tokens,
``n`` from ``max_matching_ngram_size`` down to 1; at the latest earlier occurrence, the tokens that
followed it are the drafts, at most ``max_draft_len``:

    tokens   ... a b c d e ... x a b c      newest 3 = "a b c", seen before at "a b c d e"
    drafts   d e ...                        (verified by the target model in one forward)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trtllm_vtoken.config_base import from_dict, require_positive


@dataclass(frozen=True)
class NGramDecodingConfig:
    """TensorRT-LLM's ``NGramDecodingConfig`` fields this runtime takes (``decoding_type="NGram"``)."""

    max_draft_len: int = 4
    """Draft tokens per request and step, at most."""
    max_matching_ngram_size: int = 2
    """Longest n-gram looked up (then shorter ones)."""

    def __post_init__(self) -> None:
        require_positive(self, "max_draft_len", "max_matching_ngram_size")

    @classmethod
    def of(cls, value: Any) -> NGramDecodingConfig | None:
        """From a config, a dict (TensorRT-LLM's spelling; ``decoding_type`` "NGram" if given) or
        None. ValueError for another decoding type or an unknown field."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            values = dict(value)
            kind = values.pop("decoding_type", "NGram")
            if kind != "NGram":
                raise ValueError(f"speculative decoding {kind!r} is not offered: only 'NGram' (prompt lookup, no "
                                 "draft model) runs in the reference runtime")
            return from_dict(cls, values)
        raise TypeError(f"speculative_config must be an NGramDecodingConfig or a dict, got {type(value).__name__}")


def ngram_drafts(tokens: list[int], config: NGramDecodingConfig, limit: int) -> list[int]:
    """Draft tokens following the latest earlier occurrence of ``tokens``' newest n-gram; at most
    ``min(config.max_draft_len, limit)``; [] when none matches."""
    room = min(config.max_draft_len, limit)
    if room <= 0:
        return []
    for n in range(min(config.max_matching_ngram_size, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + room]
    return []
