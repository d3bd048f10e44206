# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the project's frozen config dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

C = TypeVar("C")


def from_dict(cls: type[C], values: dict[str, Any]) -> C:
    """Constructs the dataclass ``cls`` from ``values``; an unknown key is a ValueError, never ignored."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; known: {sorted(known)}")
    return cls(**values)


def require_positive(config: Any, *names: str) -> None:
    """ValueError naming the first of ``config``'s fields ``names`` that is not positive."""
    for name in names:
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
