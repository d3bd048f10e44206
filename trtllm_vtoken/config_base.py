# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the project's frozen config dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any, TypeVar

C = TypeVar("C")


def from_dict(cls: type[C], values: dict[str, Any]) -> C:
    """Constructs the dataclass ``cls`` from ``values``; an unknown key is a ValueError, never ignored."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}{did_you_mean(unknown, known)}; "
                         f"known: {sorted(known)}")
    return cls(**values)


def did_you_mean(unknown: Iterable[str], known: Iterable[str]) -> str:
    """" (did you mean 'top_p'?)" for the known names closest to the unknown ones; "" if none is
    close."""
    known = sorted(known)
    close = [m for name in unknown for m in difflib.get_close_matches(name, known, n=1)]
    return f" (did you mean {', '.join(repr(m) for m in close)}?)" if close else ""


def require_positive_ints(**values: Any) -> None:
    """ValueError naming the first value that is not a positive int (a bool is not one)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def require_positive(config: Any, *names: str) -> None:
    """ValueError naming the first of ``config``'s fields ``names`` that is not positive."""
    for name in names:
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
