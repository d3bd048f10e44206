# SPDX-License-Identifier: Apache-2.0
"""Plain-text tables and JSON output for benchmark results."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown-compatible table; floats are shown with 2 decimals."""

    def cell(value: Any) -> str:
        return f"{value:,.2f}" if isinstance(value, float) else str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.rjust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in text)])


def write_json(out_dir: str | Path, name: str, payload: Any) -> Path:
    """Writes ``<out_dir>/<name>.json`` (creating the folder) and returns its path."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
