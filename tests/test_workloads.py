# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from trtllm_vtoken.workloads import WORKLOADS, make_workload
from trtllm_vtoken.workloads.sharegpt import conversations


class WordCounter:
    """Whitespace tokens: workloads only count and cut, so any tokenizer-shaped counter serves."""

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * n for n in ids)


def test_sharegpt_reads_complete_conversations_incrementally():
    convs = list(conversations(limit=300, chunk_chars=1 << 14))  # many refills mid-object
    assert len(convs) == 300 and all("conversations" in c for c in convs)
    assert convs == list(conversations(limit=300))


@pytest.mark.parametrize("name", sorted(WORKLOADS.names()))
def test_workloads_are_reproducible_and_within_lengths(name):
    counter = WordCounter()
    items = make_workload(name, 12, counter, seed=3, max_prompt_tokens=400, max_output_tokens=64)
    again = make_workload(name, 12, counter, seed=3, max_prompt_tokens=400, max_output_tokens=64)
    assert items == again and len(items) == 12
    assert len({i.source for i in items}) == 12
    for item in items:
        assert len(counter.encode(item.prompt)) <= 400 and 8 <= item.max_tokens <= 64
    assert make_workload(name, 12, counter, seed=4, max_prompt_tokens=400) != items


def test_bad_workload_requests_raise():
    with pytest.raises(KeyError, match="Unknown workload"):
        make_workload("longbench-v9", 3, WordCounter())
    with pytest.raises(ValueError, match="must be positive"):
        make_workload("sharegpt", 0, WordCounter())
