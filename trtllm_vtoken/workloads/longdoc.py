# SPDX-License-Identifier: Apache-2.0
"""LongBench-like requests: a long document plus a task, answered in a few hundred tokens.

Documents are the CPython standard library's own sources (present wherever Python is, no
download) standing in for LongBench's code and technical-prose tasks. Each request takes a file,
cuts it to a prompt length drawn uniformly from ``[max_prompt_tokens / 2, max_prompt_tokens]``
and asks one of a few summarisation / question tasks about it.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from trtllm_vtoken.workloads.base import WORKLOADS, TokenCounter, WorkloadItem

TASKS = (
    "Summarize what the following Python module does, in a few sentences.",
    "List the main classes and functions defined in the following code and what each is for.",
    "Explain the purpose of the following source file to a new contributor.",
)


def stdlib_files() -> list[Path]:
    """The standard library's .py files, tests and packaging helpers excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


@WORKLOADS.register("longdoc")
def longdoc_workload(n: int, tokenizer: TokenCounter, *, seed: int, max_prompt_tokens: int,
                     max_output_tokens: int) -> list[WorkloadItem]:
    rng = random.Random(seed)
    files = stdlib_files()
    rng.shuffle(files)
    items: list[WorkloadItem] = []
    for path in files:
        task = rng.choice(TASKS)
        budget = rng.randint(max(1, max_prompt_tokens // 2), max_prompt_tokens) - len(tokenizer.encode(task)) - 4
        try:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if budget <= 0 or len(ids) < budget:
            continue  # too short to fill the drawn length
        document = tokenizer.decode(ids[:budget])
        output = rng.randint(max(8, max_output_tokens // 2), max_output_tokens)
        items.append(WorkloadItem(f"{task}\n\n{document}", output, f"stdlib:{path.name}"))
        if len(items) == n:
            return items
    raise ValueError(f"only {len(items)} stdlib files reach {max_prompt_tokens // 2} tokens")
