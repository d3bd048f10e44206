# SPDX-License-Identifier: Apache-2.0
"""Name -> implementation registries (policies, compaction modes, benchmarks)."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations, filled by a decorator that returns what it decorates.

    >>> POLICIES: Registry[type] = Registry("eviction policy")
    >>> @POLICIES.register("h2o")
    ... class H2O: ...
    >>> POLICIES.get("h2o") is H2O
    True
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        """Returns the item called ``name``. Raises KeyError listing the known names on a miss."""
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(self.names())
            raise KeyError(f"Unknown {self.kind} {name!r}. Known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
