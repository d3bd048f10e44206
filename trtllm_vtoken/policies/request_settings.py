# SPDX-License-Identifier: Apache-2.0
"""Eviction settings per request, on top of the engine's.

One server serves clients with different needs: one wants its whole context kept, another is
happy with a 512-token window. A request may therefore name its own policy, budget and sink /
window options (``EvictionSettings``); what it leaves unset comes from the engine's policy
(``PolicySpec``). ``resolve`` merges the two into the spec the request runs with, or None when
the request opts out (``policy="native"``: nothing of it is evicted).

    engine    PolicySpec("h2o", Budget(ratio=0.5), (("recent_ratio", 0.5),))
    request   EvictionSettings(budget=512)                  -> h2o, 512 tokens, recent_ratio 0.5
    request   EvictionSettings(policy="streaming_llm",
                               n_sink=4, budget=0.25)       -> streaming_llm, 0.25, n_sink 4
    request   EvictionSettings(policy="native")             -> None (full retention)

Specs are hashable: a host keeps one policy object per distinct spec (a policy's statistics are
kept per request inside it), so requests with different settings share one batch. Every value is
checked on construction: a bad one raises ValueError with a message fit for the client (a
400-class answer), never a KeyError or a crash deep in the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trtllm_vtoken.policies.base import POLICIES, EvictionPolicy, make_policy, option_fields
from trtllm_vtoken.policies.budget import Budget

NATIVE = "native"
"""The policy name by which a request opts out of eviction."""

_OPTION_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class PolicySpec:
    """A policy by name, budget and options: what a policy object is built from."""

    name: str
    budget: Budget
    options: tuple[tuple[str, Any], ...] = ()
    """Sorted (name, value) pairs of the policy's own fields (``n_sink``, ``recent_ratio``, ...)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _frozen_options(self.options))
        self.make()  # ValueError for an unknown policy, option or bad value

    @classmethod
    def of(cls, name: str, budget: Budget | int | float | str, options: Mapping[str, Any] | None = None
           ) -> PolicySpec:
        return cls(_known_policy(name), _budget(budget), _frozen_options(options or {}))

    def make(self) -> EvictionPolicy:
        """A fresh policy object for this spec."""
        _check_option_types(_known_policy(self.name), self.options)
        return make_policy(self.name, self.budget, **dict(self.options))

    def __str__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.options)
        return f"{self.name} ({self.budget}{extra})"


@dataclass(frozen=True)
class EvictionSettings:
    """A request's own eviction settings. Unset fields (None) take the engine's values."""

    policy: str | None = None
    """A registered policy, ``"native"`` (evict nothing of this request), or None (the engine's)."""
    budget: int | float | str | None = None
    """Live tokens kept: a count (``512``) or a retention ratio in (0, 1] (``0.25``)."""
    n_sink: int | None = None
    """First tokens never evicted (attention sinks)."""
    recent_window: int | None = None
    """Newest tokens never evicted."""
    options: Mapping[str, Any] | tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    """Further options of the named policy (e.g. ``{"recent_ratio": 0.3}`` for h2o)."""

    def __post_init__(self) -> None:
        if self.policy is not None:
            if not isinstance(self.policy, str):
                raise ValueError(f"policy must be a string, got {self.policy!r}")
            if self.policy != NATIVE:
                _known_policy(self.policy)
        if self.budget is not None:
            object.__setattr__(self, "budget", _budget(self.budget))
        for name in ("n_sink", "recent_window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        options = _frozen_options(self.options)
        clash = {"n_sink", "recent_window", "budget"} & {k for k, _ in options}
        if clash:
            raise ValueError(f"set {sorted(clash)} as fields, not as options")
        object.__setattr__(self, "options", options)
        if self.policy == NATIVE and (self.budget is not None or self.n_sink is not None
                                      or self.recent_window is not None or options):
            raise ValueError("policy 'native' evicts nothing: it takes no budget or options")
        if self.policy not in (None, NATIVE):  # the options must be the named policy's own
            self.resolve(PolicySpec(self.policy, Budget(ratio=1.0)))

    @property
    def is_default(self) -> bool:
        """Nothing set: the request runs with the engine's policy as is."""
        return self == EvictionSettings()

    def resolve(self, engine: PolicySpec | None) -> PolicySpec | None:
        """The spec this request runs with, or None if it evicts nothing.

        ``engine`` is the engine's spec (None: the engine has no policy of its own; a request
        must then name one to evict). Raises ValueError for a combination that is invalid, e.g.
        an option the policy does not have.
        """
        if self.policy == NATIVE:
            return None
        name = self.policy or (engine.name if engine else None)
        if name is None:
            if self.is_default:
                return None
            raise ValueError("this engine has no eviction policy of its own: name one with 'policy'")
        same = engine is not None and name == engine.name
        budget = self.budget if self.budget is not None else (engine.budget if engine else None)
        if budget is not None and engine is not None:  # the unit is the host's (whole blocks on TensorRT-LLM)
            budget = budget.in_units(engine.budget.unit)
        if budget is None:
            raise ValueError(f"policy {name!r} needs a budget (a token count or a ratio)")
        options = dict(engine.options) if same else {}
        options.update(self.options)
        for key in ("n_sink", "recent_window"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        return PolicySpec(name, budget, _frozen_options(options))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EvictionSettings:
        """From a JSON-like mapping; an unknown key is a ValueError naming the known ones."""
        known = {"policy", "budget", "n_sink", "recent_window", "options"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown eviction setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def _known_policy(name: str) -> str:
    if name not in POLICIES:
        known = ", ".join([NATIVE, *POLICIES.names()])
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}")
    return name


def _check_option_types(name: str, options: tuple[tuple[str, Any], ...]) -> None:
    """Each option must be a public field of the policy, of its default's type (a float field
    takes an int too)."""
    fields = option_fields(name)
    for key, value in options:
        if key not in fields:
            raise ValueError(f"unknown option {key!r} for policy {name!r}; known: {sorted(fields)}")
        default = fields[key].default
        if default is dataclasses.MISSING or default is None:
            continue
        kind = type(default)
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"option {key!r} of policy {name!r} must be {kind.__name__}, got {value!r}")


def _budget(value: Budget | int | float | str) -> Budget:
    if isinstance(value, Budget):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"budget must be finite, got {value}")
    try:
        return Budget.parse(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad budget {value!r}: {exc}") from None


def _frozen_options(options: Mapping[str, Any] | tuple) -> tuple[tuple[str, Any], ...]:
    items = options.items() if isinstance(options, Mapping) else options
    try:
        pairs = sorted((str(k), v) for k, v in items)
    except (TypeError, ValueError):
        raise ValueError(f"options must be a mapping of names to values, got {options!r}") from None
    for key, value in pairs:
        if not isinstance(value, _OPTION_TYPES) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"option {key!r} must be a finite number, a bool or a string, got {value!r}")
    return tuple(pairs)
