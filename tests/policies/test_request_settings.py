# SPDX-License-Identifier: Apache-2.0
"""Per-request eviction settings: merged with the engine's, validated with clients' errors."""

from __future__ import annotations

import pytest

from trtllm_vtoken.policies import Budget
from trtllm_vtoken.policies.request_settings import EvictionSettings, PolicySpec

ENGINE = PolicySpec.of("h2o", 0.5, {"recent_ratio": 0.3, "n_sink": 2})


def test_unset_fields_come_from_the_engine():
    assert EvictionSettings().resolve(ENGINE) == ENGINE
    assert EvictionSettings(budget=512).resolve(ENGINE) == PolicySpec(
        "h2o", Budget(tokens=512), (("n_sink", 2), ("recent_ratio", 0.3)))
    assert EvictionSettings(n_sink=0, recent_window=16).resolve(ENGINE).options == (
        ("n_sink", 0), ("recent_ratio", 0.3), ("recent_window", 16))


def test_another_policy_takes_only_its_own_options_and_the_engine_budget():
    spec = EvictionSettings(policy="streaming_llm", n_sink=4).resolve(ENGINE)
    assert spec == PolicySpec("streaming_llm", Budget(ratio=0.5), (("n_sink", 4),))
    assert str(spec) == "streaming_llm (0.5 of length, n_sink=4)"
    assert spec.make().n_sink == 4 and spec.make().budget == Budget(ratio=0.5)


def test_native_opts_out_and_a_policyless_engine_needs_a_name():
    assert EvictionSettings(policy="native").resolve(ENGINE) is None
    assert EvictionSettings().resolve(None) is None
    assert EvictionSettings(policy="random", budget=8).resolve(None) == PolicySpec("random", Budget(tokens=8))
    with pytest.raises(ValueError, match="no eviction policy of its own"):
        EvictionSettings(budget=8).resolve(None)
    with pytest.raises(ValueError, match="needs a budget"):
        EvictionSettings(policy="random").resolve(None)


def test_specs_are_hashable_so_equal_settings_share_one_policy_object():
    a = EvictionSettings(budget="0.25").resolve(ENGINE)
    b = EvictionSettings(budget=0.25).resolve(ENGINE)
    assert a == b and len({a, b, ENGINE}) == 2


@pytest.mark.parametrize("values, message", [
    (dict(policy="h2oo"), "unknown eviction policy 'h2oo'; known: native, h2o"),
    (dict(policy=3), "policy must be a string"),
    (dict(budget=-1), "budget must not be negative"),
    (dict(budget=1.5), r"retention ratio must lie in \(0, 1\]"),
    (dict(budget="lots"), "neither a token count nor a ratio"),
    (dict(budget=float("inf")), "budget must be finite"),
    (dict(budget=True), "budget must be a number"),
    (dict(budget=[1]), "bad budget"),
    (dict(n_sink=-1), "n_sink must be a non-negative integer"),
    (dict(recent_window=2.5), "recent_window must be a non-negative integer"),
    (dict(policy="native", budget=4), "'native' evicts nothing"),
    (dict(options={"n_sink": 1}), r"set \['n_sink'\] as fields"),
    (dict(policy="h2o", options={"recent_ratio": "high"}), "must be float"),
    (dict(policy="h2o", options={"_mass": 0}), "unknown option '_mass' for policy 'h2o'"),
    (dict(policy="h2o", options={"recent_ratio": 2.0}), r"recent_ratio must lie in \[0, 1\]"),
    (dict(policy="random", options={"seed": float("nan")}), "finite number"),
])
def test_bad_values_are_value_errors_naming_the_problem(values, message):
    with pytest.raises(ValueError, match=message):
        EvictionSettings(**values)


def test_from_dict_refuses_unknown_keys():
    assert EvictionSettings.from_dict({"policy": "random", "budget": 4}) == EvictionSettings("random", Budget(tokens=4))
    with pytest.raises(ValueError, match=r"unknown eviction setting\(s\) \['budgett'\]"):
        EvictionSettings.from_dict({"budgett": 4})
