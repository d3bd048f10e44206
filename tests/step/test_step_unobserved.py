# SPDX-License-Identifier: Apache-2.0
"""``StepInput.unobserved``: a step that takes in tokens a later forward wrote (the overlap
scheduler's step beside the next forward) observes only the tokens its mass's forward attended.
Held against the plain order: one token per step, each observed by the step after its forward.
Scissorhands counts the live tokens for its mean and shifts each token's history, so a token
seen early would change both; H2O adds 0 there."""

from __future__ import annotations

import numpy as np
import pytest

from tests.step.drive import Host, make_step
from trtllm_vtoken.policies import make_policy

TPB = 4


def steps(impl: str, policy: str) -> tuple:
    """Two fresh steps over their own hosts with one 5-token request each, prompt observed."""
    out = []
    for _ in range(2):
        host = Host(16, TPB)
        step = make_step(host, impl, "dense", policy=make_policy(policy, 7, **OPTIONS[policy]))
        step.add_request(0)
        step.run(decode_input(host, step, 5, np.array([[0.3, 0.1, 0.4, 0.1, 0.1]])))
        out.append((host, step))
    return tuple(out)


OPTIONS = {"scissorhands": {"history_window": 4, "recent_window": 1}, "h2o": {}}
MASS = {5: np.array([[0.15, 0.3, 0.15, 0.15, 0.1, 0.15, 0.0]]), 6: np.array([[0.2, 0.1, 0.1, 0.3, 0.1, 0.1, 0.1]]),
        7: np.array([[0.1, 0.1, 0.2, 0.1, 0.2, 0.1, 0.1, 0.1]])}
"""Forward k's mass over positions 0-k, zero past them. Forward 5's sums to 1 and gives four tokens
0.15: below the mean over the 6 tokens it attended (1/6), above it over 7 (1/7), where a token it did
not attend would count."""


def decode_input(host: Host, step, num_new: int, mass: np.ndarray, unobserved=None):
    from trtllm_vtoken.step import StepInput

    have = step.num_blocks(0) if 0 in step.request_ids() and step.num_tokens(0) else 0
    kv_len = step.kv_len(0) if have else 0
    need = -(-(kv_len + num_new) // TPB) - have
    return StepInput.of_lists([0], [num_new], [host.allocate(need)], mass=mass, unobserved=unobserved)


@pytest.mark.parametrize("impl", ["cpp", "python"])
@pytest.mark.parametrize("policy", ["scissorhands", "h2o"])
def test_tokens_taken_in_before_their_forward_are_observed_as_in_the_plain_order(impl, policy):
    """Budget 7, a 5-token prompt: forwards 5, 6 and 7 attend positions 0-5, 0-6 and 0-7; the
    8th token evicts one. Plain: a step after each forward. Beside (deciding at once): tokens 5
    and 6 with forward 5's mass (6 not attended), then forward 6's mass alone (its step may evict
    with the next token: at once), then token 7 with its forward's."""
    (host_a, plain), (host_b, beside) = steps(impl, policy)
    mass = MASS
    for k in (5, 6):
        plain.run(decode_input(host_a, plain, 1, mass[k][:, : k + 1]))
    beside.run(decode_input(host_b, beside, 2, mass[5], unobserved=[1]))
    beside.run(decode_input(host_b, beside, 0, mass[6]))
    stat = "history" if policy == "scissorhands" else "mass"
    assert [a.tolist() for a in plain.token_stats(0, stat)] == [a.tolist() for a in beside.token_stats(0, stat)]
    out_plain = plain.run(decode_input(host_a, plain, 1, mass[7]))
    out_beside = beside.run(decode_input(host_b, beside, 1, mass[7]))
    assert list(out_plain.victims_of(0)) == list(out_beside.victims_of(0)) and len(out_plain.victims_of(0)) == 1
    assert [a.tolist() for a in plain.token_stats(0, stat)] == [a.tolist() for a in beside.token_stats(0, stat)]


def test_without_unobserved_a_token_taken_in_early_changes_scissorhands_statistics():
    """The same two steps beside forward 6 as above, ``unobserved`` left out: the token forward 5
    did not attend counts in its mean, and the statistics part from the plain order's."""
    (host_a, plain), (host_b, beside) = steps("python", "scissorhands")
    for k in (5, 6):
        plain.run(decode_input(host_a, plain, 1, MASS[k][:, : k + 1]))
    beside.run(decode_input(host_b, beside, 2, MASS[5]))
    beside.run(decode_input(host_b, beside, 0, MASS[6]))
    assert [a.tolist() for a in plain.token_stats(0, "history")] != \
        [a.tolist() for a in beside.token_stats(0, "history")]


@pytest.mark.parametrize("unobserved", [[2], [-1], [0, 0]])
def test_unobserved_outside_the_new_tokens_is_refused_and_nothing_changes(unobserved):
    (host, step), _ = steps("python", "scissorhands")
    before = step.table_digest()
    with pytest.raises(ValueError, match="unobserved must give each"):
        step.run(decode_input(host, step, 1, np.zeros((1, 6)), unobserved=unobserved))
    assert step.table_digest() == before
