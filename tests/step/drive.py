# SPDX-License-Identifier: Apache-2.0
"""Random batches for the step's tests: requests joining and leaving, prefill and decode rows,
several policies in one batch (and requests that never evict), blocks becoming shared."""

from __future__ import annotations

import numpy as np
import torch

from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

POLICY_SPECS = [("h2o", 6, {}), ("scissorhands", 0.6, {"history_window": 3, "recent_window": 2}),
                ("streaming_llm", 5, {"n_sink": 2}), ("sliding_window", 0.5, {}), ("random", 7, {"seed": 3})]


class Host:
    """A block pool (free list, shared set) and a KV pool, as a host keeps them."""

    def __init__(self, num_blocks: int, tpb: int, seed: int = 0) -> None:
        self.num_blocks, self.tpb = num_blocks, tpb
        self.free = list(range(num_blocks))
        self.shared: set[int] = set()
        gen = torch.Generator().manual_seed(seed)
        self.kv = torch.randn(num_blocks, 2, 2, 1, tpb, 4, generator=gen)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"the test's pool has {len(self.free)} free blocks, {n} asked for: make it larger")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, blocks) -> None:
        self.free.extend(int(b) for b in blocks)


def make_step(host: Host, impl: str, compaction: str, threshold: int = 1, policy=None,
              checks: bool = True, on_victims=None, reduce_mass=None) -> DecodeStep:
    """``compaction`` "lazy-background": lazy compaction committing a step later (StepConfig.background);
    ``checks``: StepConfig.check_invariants (I1/I2 around every step); ``on_victims``: the victims hook;
    ``reduce_mass``: the step's (as tensor / pipeline parallelism's)."""
    background = compaction == "lazy-background"
    config = StepConfig("lazy" if background else compaction, threshold, check_invariants=checks, impl=impl,
                        background=background)
    return DecodeStep(config, host.num_blocks, host.tpb, policy, TorchCopyExecutor([host.kv]),
                      host.shared.__contains__, lambda: host.shared, reduce_mass=reduce_mass, on_victims=on_victims)


def decided_in_python(policy):
    """The policy without a bounds rule: the step decides for it in Python and hands the victims to
    its call, as for a policy only Python decides (``BatchDecision.native_decision``)."""
    if policy is not None:
        policy.__class__ = type(f"InPython{type(policy).__name__}", (type(policy),), {"bounds_rule": lambda self: None})
    return policy


def join_some(rng: np.random.Generator, steps, first_id: int) -> list[int]:
    """0-2 new requests, ids from ``first_id`` on, added to every step alike (each step's default
    policy); returns their ids."""
    joining = list(range(first_id, first_id + int(rng.integers(0, 3))))
    for step in steps:
        for req in joining:
            step.add_request(req)
    return joining


def random_policies(rng: np.random.Generator) -> list:
    """Fresh policy objects, one per spec, plus None (a request that opts out)."""
    return [make_policy(name, budget, **options) for name, budget, options in POLICY_SPECS] + [None]


RUNNING_NEW = (1, 1, 1, 1, 1, 1, 0, 2, 3)
"""A running row's new tokens, drawn with these weights. Rows of 0 and 2 in one batch sum to the
row count as a decode step's ones do: the Python core once took them for one token each."""


def random_batch(rng: np.random.Generator, step: DecodeStep, host: Host, new_requests: list[int],
                 non_finite: bool = False) -> StepInput:
    """A batch of some running requests (one token each, now and then none or a few: a row that
    takes nothing in, accepted drafts) and the new ones (a prompt each), with the blocks the host
    allocates for them and a random attention mass; ``non_finite``: NaN, +inf and -inf in it here
    and there, now and then a row all NaN (an attention that overflowed)."""
    running = [r for r in step.request_ids() if r not in new_requests]
    rows = [r for r in running if rng.random() < 0.8] + new_requests
    rows = [rows[i] for i in rng.permutation(len(rows))]
    num_new, blocks = [], []
    for req in rows:
        n = int(rng.integers(1, 4 * host.tpb)) if req in new_requests else int(rng.choice(RUNNING_NEW))
        need = -(-(step.kv_len(req) + n) // host.tpb) - step.num_blocks(req)
        num_new.append(n)
        blocks.append(host.allocate(max(need, 0) + int(rng.random() < 0.05)))
    width = max((step.kv_len(r) + n for r, n in zip(rows, num_new)), default=0) + int(rng.integers(0, 3))
    if rng.random() < 0.3:  # ties on purpose: a few distinct values
        mass = rng.choice([0.0, 0.5, 1.0, 2.0], size=(len(rows), width))
    else:
        mass = rng.random((len(rows), width)) * rng.lognormal(0, 2, (len(rows), width))
    if non_finite:
        odd = rng.random(mass.shape)
        mass[odd < 0.03] = np.nan
        mass[(odd >= 0.03) & (odd < 0.05)] = np.inf
        mass[(odd >= 0.05) & (odd < 0.06)] = -np.inf
        mass[rng.random(len(rows)) < 0.2] = np.nan
    if rng.random() < 0.3:
        mass = mass.astype(np.float32)  # what attention kernels return
    pressure = bool(rng.random() < 0.15)
    if rng.random() < 0.5:  # the new blocks as the engine passes them: one list per request
        return StepInput.of_lists(rows, num_new, blocks, mass=mass, pressure=pressure)
    offsets = np.cumsum([0] + [len(b) for b in blocks])
    return StepInput(rows, num_new, offsets, [b for bl in blocks for b in bl], mass=mass, pressure=pressure)


def share_a_block(rng: np.random.Generator, steps: list[DecodeStep], hosts: list[Host], chance: float) -> None:
    """With probability ``chance``, a random request's first block becomes shared in every host
    (prefix caching), if it is full and no background compaction in flight touches it."""
    if rng.random() >= chance or not steps[0].request_ids():
        return
    req = int(rng.choice(steps[0].request_ids()))
    busy = set().union(*(step.relocating_blocks() for step in steps))
    if steps[0].kv_len(req) >= hosts[0].tpb and steps[0].block_ids(req)[0] not in busy:
        for host in hosts:
            host.shared.add(steps[0].block_ids(req)[0])


def same_batches(rng: np.random.Generator, steps: list[DecodeStep], hosts: list[Host],
                 new_requests: list[int], non_finite: bool = False) -> list[StepInput]:
    """``random_batch`` once per step, from the same random state: the same batch for each."""
    state, inputs = rng.bit_generator.state, []
    for step, host in zip(steps, hosts):
        rng.bit_generator.state = state
        inputs.append(random_batch(rng, step, host, new_requests, non_finite))
    return inputs
