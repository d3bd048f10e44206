# SPDX-License-Identifier: Apache-2.0
"""The engine's forwards: one over rows of new tokens (a decode batch, or one prefill), on the
model, its captured CUDA graphs, or the simulated backend, and the batch's attention mass as the
step takes it.

    run(rows, tokens)   positions (logical or physical), slots (the KV manager's reservations),
                        set_batch (the static tables), then ``before_model`` (the overlap
                        scheduler starts the previous iteration's step here: the layout this
                        forward reads is fixed), then the model; one copy of the logits and the
                        mass to the host
    batch_mass(...)     the mass of the rows going on, [B, width], as ``DecodeStep`` takes it
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from trtllm_vtoken.runtime.batch_invariance import intra_op_threads, invariant_products
from trtllm_vtoken.runtime.mass_staging import MassStaging


class Forwards:
    """Runs the engine's forwards over its KV manager (``kv``) and model.

    Args:
        graphs: Captured decode graphs (None: eager).
        consistency: The ranks' agreement (``RankConsistency``): the mass is summed over them.
        stats: The engine's stats (``forward_seconds`` grows).
        batch_invariant: Batch-invariant forwards (``runtime/batch_invariance.py``): every product
            on a multiple of the rows this machine's BLAS needs, measured here for the thread count
            and again if the thread count changes; where no multiple serves it, the forward runs on
            one thread (a warning; RuntimeError where none serves one thread either).
    """

    def __init__(self, model: Any, kv: Any, graphs: Any, consistency: Any, stats: Any, device: str,
                 max_batch_size: int, max_positions: int, batch_invariant: bool = False) -> None:
        self.model, self.kv, self.graphs, self.consistency, self.stats = model, kv, graphs, consistency, stats
        self.batch_invariant = batch_invariant
        self._row_multiples: dict[int, tuple[int, int]] = {}  # thread count -> (rows every product
        # is padded to, threads the forward runs on)
        self.invariance()
        self.device = device
        self.simulated = getattr(model, "simulated", False)
        self.mass_staging = MassStaging(max_batch_size, max_positions)
        self.before_model: Callable[[], None] | None = None
        """Called once, after the next forward's tables are written and before its model runs
        (the simulated backend: after its forward was launched on the simulated device)."""
        self.device_ready = 0.0
        """The simulated backend with device time: when the device finishes the forwards launched."""

    def invariance(self) -> tuple[int, int]:
        """(row multiple, threads) of a forward at the process's thread count now: (0, that
        count) off; batch-invariant, ``invariant_products``' pair, measured once per count."""
        threads = torch.get_num_threads()
        if not self.batch_invariant:
            return 0, threads
        if threads not in self._row_multiples:
            self._row_multiples[threads] = invariant_products(self.model)
        return self._row_multiples[threads]

    def _layout_fixed(self) -> None:
        if self.before_model is not None:
            hook, self.before_model = self.before_model, None
            hook()

    def run(self, req_ids: list[int], tokens: list[list[int]], prefill: bool = False, prompt_after: int = 0,
            verify: bool = False, first_prefill: bool = True):
        """One forward over rows of new tokens; returns its rows' last logits (one row each, on the
        host) and its mass [rows, L] (None without one). ``prefill``: one request's prompt (after
        its cached prefix), or a chunk of it followed by ``prompt_after`` more prompt tokens;
        ``first_prefill``: its first chunk (the one whose mass takes in the cached prefix's).
        ``verify``: decode rows with draft tokens: the logits of every row's every token [rows, T,
        vocab], and the mass of each row's first 1, 2, ... T queries [rows, T, L] (the step takes
        the accepted ones')."""
        if self.simulated:  # no model runs (token 1 always); the mass comes at the step
            self.kv.set_batch(req_ids)
            if self.model.device_forward_us:  # launched: the device computes, this thread goes on
                now = time.perf_counter()
                self.device_ready = max(now, self.device_ready) + 1e-6 * self.model.device_forward_us
            self._layout_fixed()
            return torch.tensor([[0.0, 1.0]]).expand(len(req_ids), 2), None
        kv, device = self.kv, self.device
        longest = max(len(t) for t in tokens)
        input_ids = torch.zeros(len(req_ids), longest, dtype=torch.long)
        positions = torch.zeros_like(input_ids)
        slots = torch.full_like(input_ids, -1)
        for i, (req_id, row) in enumerate(zip(req_ids, tokens)):
            first = kv.next_position(req_id)  # logical ("keep") or physical ("shift")
            input_ids[i, : len(row)] = torch.tensor(row)
            positions[i, : len(row)] = torch.arange(first, first + len(row))
            slots[i, : len(row)] = torch.tensor(kv.staged_slots(req_id))
        valid = kv.set_batch(req_ids)
        self._layout_fixed()
        # A batch-invariant prompt's mass comes per block of its positions, folded onto its cached
        # prefix's in block order (kv.prefill_mass_blocks); otherwise a prefill that stores prompt
        # blocks cuts its mass at their ends (prefix caching keeps what a cached prefix's queries
        # paid, see runtime/prefix_caching.py).
        (row_multiple, threads), observes_prompt = self.invariance(), prefill and first_prefill and kv.needs_attention
        tpb = kv.config.tokens_per_block
        mass_blocks = (first % tpb, tpb) if row_multiple and observes_prompt else None
        cuts = kv.mass_cuts(req_ids[0]) if observes_prompt and mass_blocks is None else []
        if verify and kv.needs_attention:  # the mass of the first 1 .. T queries, T the row's own at most
            cuts = [[min(j, len(row)) for j in range(1, longest + 1)] for row in tokens]
        start = time.perf_counter()
        # Graphs captured without the mass serve no batch once a request's own policy needs it, nor
        # a one-token prefill whose mass is cut at a block it stores (the graphs return no cuts).
        if self.graphs is not None and longest == 1 and not cuts and mass_blocks is None and \
                (self.graphs.return_mass or not kv.needs_attention):
            logits, mass = self.graphs.run(input_ids, positions, slots, valid)
        else:
            q_lens = torch.tensor([len(t) for t in tokens]).to(device)
            mass_cuts = None if not cuts else torch.tensor(cuts if verify else [cuts])
            with intra_op_threads(threads):  # batch-invariant: one thread where no P serves more
                logits, mass = self.model(
                    input_ids.to(device), positions.to(device), slots.to(device), q_lens,
                    kv.cache, valid, return_mass=kv.needs_attention, logits_at=None if verify else q_lens - 1,
                    carry_mass=self.consistency.carry, mass_cuts=mass_cuts,
                    mass_from=self._mass_from(req_ids, tokens, prompt_after) if prefill and kv.needs_attention
                    else None, row_multiple=row_multiple, mass_blocks=mass_blocks,
                )
        mass = self.consistency.reduce_mass(mass)  # every rank's heads: identical decisions
        # One device-to-host copy per forward for all rows (the policy reads each row on the host);
        # it also takes the graph's reused output buffers out of the way of the next replay.
        last = logits.float().cpu()
        mass = None if mass is None else mass.float().cpu()
        self.stats.forward_seconds += time.perf_counter() - start
        cut_mass = None
        if verify:
            return last[: len(req_ids)], None if mass is None else mass[: len(req_ids), :-1]
        if mass_blocks is not None:  # [1, 2, blocks, L]: every query's, the observed ones'
            return last[:1], kv.prefill_mass_blocks(req_ids[0], mass[0, 0], mass[0, 1])[None]
        if cuts:
            mass, cut_mass = mass[:, -1], mass[0, :-1]
        if prefill and first_prefill and mass is not None:
            mass = kv.prefill_mass(req_ids[0], mass[0], cut_mass)[None]
        return last[: len(req_ids)], None if mass is None else mass[: len(req_ids)]  # a graph's padding rows left out

    def _mass_from(self, req_ids: list[int], tokens: list[list[int]], prompt_after: int) -> torch.Tensor | None:
        """[B] the first query of each prefill row its policy observes (H2O's prefill_window: the
        prompt's last queries, of which a chunk followed by ``prompt_after`` prompt tokens holds
        the last ``window - prompt_after``), or None when every row's policy observes them all."""
        policies = [self.kv.policy_of(r) for r in req_ids]
        windows = [None if p is None else p.observed_prefill_queries() for p in policies]
        if all(w is None for w in windows):
            return None
        return torch.tensor([0 if w is None else len(row) - min(len(row), max(0, w - prompt_after))
                             for w, row in zip(windows, tokens)]).to(self.device)

    def wait(self) -> None:
        """Waits for the forwards launched to finish: the simulated device's time (a real
        forward has returned its logits to the host already)."""
        if not self.device_ready:  # no device time to wait for
            return
        remaining = self.device_ready - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def batch_mass(self, req_ids: list[int], masses: list, queries: list[int]):
        """The attention mass of the requests going on, as the step takes it, [B, width]: one
        forward's float32 host tensor [B, L] as a numpy view of it, no copy (the step's call
        repeats with a new array of the same rows and dtype each step, ``step/beside.py``);
        several forwards' (each [rows, L], in the rows' order) staged in one array rewritten in
        place (``MassStaging``); or the simulated backend's own: a function of the token layout
        (its simulated attention) or a host array, handed over as they are, a torch tensor as
        the model's."""
        if not self.kv.needs_attention or not req_ids:
            return None
        if self.simulated:
            mass = self.model.batch_mass(req_ids, queries)
            if not isinstance(mass, torch.Tensor):
                return mass
            masses = [mass]
        if len(masses) == 1:
            return masses[0].detach().numpy()  # [B, L] float32 on the host (the forward's rows)
        # The step on the worker reads the staged array until it finishes: none is in flight
        # now (each iteration finishes its own), unless an iteration raised between the two.
        self.kv.finish_step()
        return self.mass_staging.stage(masses)
