# SPDX-License-Identifier: Apache-2.0
"""The continuous-batching engine: requests join and leave between steps.

One ``step()``:

    1. decode rows   every running request reserves a slot for its pending token, in one batch
                     when the free blocks cover them all; if the pool is dry, the newest running
                     request is preempted (blocks freed, re-queued first)
    2. admission     waiting requests join in arrival order while admission allows and the batch
                     has room; each reserves blocks for its prompt (plus output, if resumed)
    3. forward       one batched decode forward; one prefill forward per joining request
    4. per request   sample, detokenize, check stops
    5. the step      one call for every request that goes on (``KVCacheManager.step_batch``): the
                     new tokens join, the policy decides for the batch, compaction frees blocks
                     with one copy for the whole batch; admission is updated
    6. leaving       finished requests release every block

A request that could never fit (too long for ``max_seq_len`` or for the whole pool) is refused by
``add_request`` with a ValueError; everything else eventually runs to completion.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from trtllm_vtoken.consistency import RankConsistency, RankGroup, SingleRank
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.kv_manager import KVCacheManager
from trtllm_vtoken.runtime.logprobs import token_logprobs
from trtllm_vtoken.runtime.mass_staging import MassStaging
from trtllm_vtoken.runtime.model import LlamaForCausalLM
from trtllm_vtoken.runtime.parallel.layers import check_shard
from trtllm_vtoken.runtime.request import Request, RequestDelta, Status
from trtllm_vtoken.runtime.sampling import SamplingParams, sample
from trtllm_vtoken.runtime.tokenizer import StreamText, Tokenizer


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    """Prompt tokens the model computed (a cached prefix is not computed)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens found in the prefix cache at admission: their KV was reused, not prefilled."""
    decode_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    cancelled: int = 0
    requests_by_policy: dict[str, int] = field(default_factory=dict)
    """Requests added, by the eviction policy each runs with ("native": none)."""
    forward_seconds: float = 0.0
    """Wall time of model forwards (logits copied to the host included)."""


class Engine:
    """Runs requests through one model and one KV pool.

    Args:
        tokenizer: Needed for text output and stop strings; without one, outputs carry ids only
            and end on ``eos_token_ids``.
        record_trace: Keep, per request and generated token, the logits behind it and the
            eviction decision after it (``Request.logits``, ``Request.evictions``), for the
            variant-agreement tests and quality checks.
        ranks: With ``tensor_parallel_size`` N > 1: this process's group of N ranks, and
            ``model`` sharded for this rank (``runtime.parallel.shard_model``). Every rank runs
            the same requests in the same order; the attention mass is summed over the ranks
            before the policy scores, and with ``check_invariants`` the ranks compare their token
            tables after every step (``trtllm_vtoken.consistency``).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: frozenset[int] | None = None,
        record_trace: bool = False,
        ranks: RankGroup | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.simulated = getattr(model, "simulated", False)
        self.ranks = ranks or SingleRank()
        check_shard(model, self.config.tensor_parallel_size, self.ranks)
        self.consistency = RankConsistency(self.ranks, self.config.reduce_attention_mass)
        self.model = model if self.simulated else model.to(self.config.device, getattr(torch, self.config.dtype))
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else (
            tokenizer.eos_token_ids if tokenizer else frozenset())
        self.kv = KVCacheManager(self.config, model.config,
                                 model.shape.kv_bytes_per_token if self.simulated else None)
        self.graphs = None
        # Collectives inside captured graphs are not supported here: TP ranks run eagerly.
        if (not self.simulated and self.config.cuda_graphs and self.kv.cache.pool.is_cuda
                and self.ranks.world_size == 1):
            from trtllm_vtoken.runtime.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv.cache, self.config.max_batch_size,
                                       masked=self.kv.masks_positions, return_mass=self.kv.needs_attention)
        self.stats = EngineStats()
        self.mass_staging = MassStaging(self.config.max_batch_size,
                                        self.config.max_blocks_per_seq * self.config.tokens_per_block)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[int] = deque()
        self.running: list[int] = []  # admission order
        self.record_trace = record_trace
        self._texts: dict[int, StreamText] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._ids = itertools.count()
        self._reported: list[RequestDelta] = []
        self._specs: dict = {}  # request -> the PolicySpec it runs with (None: it evicts nothing)
        self._prefill_from: dict[int, int] = {}  # admitted this step -> cached prompt tokens

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    req_id: int | None = None) -> int:
        """Queues a request; returns its id. Raises ValueError if it can never run."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        spec = self.kv.resolve(params.eviction)
        self.kv.check_fits_alone(len(prompt_ids), params.max_tokens, spec)
        req_id = next(self._ids) if req_id is None else req_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id} is already in use")
        self.requests[req_id] = Request(req_id, prompt_ids, params, arrival=time.perf_counter())
        self._specs[req_id] = spec
        name = "native" if spec is None else spec.name
        self.stats.requests_by_policy[name] = self.stats.requests_by_policy.get(name, 0) + 1
        if self.tokenizer is not None:
            self._texts[req_id] = StreamText(self.tokenizer, params.stop or ())
        if params.seed is not None:
            self._generators[req_id] = torch.Generator().manual_seed(params.seed)
        self.waiting.append(req_id)
        return req_id

    def cancel(self, req_id: int) -> bool:
        """Stops a request and frees its blocks now; False if it had already finished."""
        request = self.requests.get(req_id)
        if request is None or request.status is Status.FINISHED:
            return False
        if request.status is Status.RUNNING:
            self.running.remove(req_id)
            self.kv.release(req_id)
        else:
            self.waiting.remove(req_id)
        self.stats.cancelled += 1
        self._finish(request, "cancelled")
        self._reported.append(self._output(request, [], ""))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, req_id: int) -> Request:
        """Forgets a finished request and returns it (the engine keeps finished ones until then)."""
        request = self.requests[req_id]
        if request.status is not Status.FINISHED:
            raise ValueError(f"request {req_id} has not finished")
        return self.requests.pop(req_id)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Runs one iteration; returns what each request that changed produced."""
        reported, self._reported = self._reported, []
        decode = self._schedule_decode()
        prefill = self._admit()
        results: list[tuple[Request, torch.Tensor, int]] = []
        masses: list[torch.Tensor | None] = []  # each forward's [rows, L], its rows in results in order
        if decode:
            forwarded, mass = self._forward(decode, [[self.requests[r].pending] for r in decode])
            results += forwarded
            masses.append(mass)
            self.stats.decode_tokens += len(decode)
        for req_id in prefill:
            cached = self._prefill_from.pop(req_id)
            ids = self.requests[req_id].prefill_ids()[cached:]  # the cached prefix is not recomputed
            forwarded, mass = self._forward([req_id], [ids], prefill=True)
            results += forwarded
            masses.append(mass)
            self.stats.prefill_tokens += len(ids)
            self.stats.cached_prompt_tokens += cached
        # One step for every row the forwards ran, begun before sampling: its new tokens join the
        # table, the policy decides for the whole batch (a request's cached chain is cut before
        # its KV can move), one copy relocates every request's KV. Its native call runs beside the
        # sampling where it can (``EngineConfig.step_overlap``); a request that finishes now leaves
        # after it. Then admission learns what each request going on holds, and the prefix cache
        # keys the blocks that filled.
        rows = [request.req_id for request, *_ in results]
        self.kv.start_step(rows, self._batch_mass(rows, masses, [r[2] for r in results]),
                           overlap=self.config.step_overlap)
        for request, logits, _ in results:
            reported.append(self._advance(request, logits))
        out = self.kv.finish_step()
        continuing = [r for r in rows if self.requests[r].status is Status.RUNNING]
        if self.record_trace:
            for i, req_id in enumerate(rows):
                if self.requests[req_id].status is Status.RUNNING:
                    self.requests[req_id].evictions.append(tuple(out.victims_of(i)) if out is not None else ())
        self.kv.update(continuing, [self.requests[r].remaining for r in continuing])
        self.kv.store_written(continuing, lambda r: self.requests[r].prefill_ids())
        if self.config.check_invariants:  # every rank: same table, same free blocks, same tokens
            sampled = [t for out in reported for t in (out.req_id, *out.new_token_ids)]
            self.consistency.check(self.stats.steps, self.kv.layout, [self.kv.pool.num_free, *sampled])
        self.stats.steps += 1
        return reported

    def _schedule_decode(self) -> list[int]:
        """Reserves the decode rows' slots. Usually the free blocks cover every row: one batch
        reservation. Otherwise one by one in admission order, the newest request preempted while
        the pool is dry (a preempted request leaves the batch; older ones keep their slots)."""
        running = list(self.running)
        if self.kv.reserve_decode(running):
            return running
        scheduled: list[int] = []
        preempted: set[int] = set()
        for req_id in running:
            if req_id in preempted:  # preempted below to make room for an older request
                continue
            while not self.kv.reserve(req_id, 1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim)
                if victim == req_id:
                    break
            else:
                scheduled.append(req_id)
        return [r for r in scheduled if r not in preempted]

    def _admit(self) -> list[int]:
        joined: list[int] = []
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.requests[self.waiting[0]]
            ids = request.prefill_ids()
            cached = self.kv.admit(request.req_id, ids, request.remaining, self._specs[request.req_id])
            if cached is None:
                break
            if not self.kv.reserve(request.req_id, len(ids) - cached):  # greedy admission raced the pool
                self.kv.release(request.req_id)
                break
            self.kv.store_prompt(request.req_id, ids)
            self._prefill_from[request.req_id] = cached
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request.req_id)
            joined.append(request.req_id)
        return joined

    def _preempt(self, req_id: int) -> None:
        request = self.requests[req_id]
        self.running.remove(req_id)
        self.kv.release(req_id)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req_id)

    def _forward(self, req_ids: list[int], tokens: list[list[int]], prefill: bool = False):
        """One forward over rows of new tokens; returns its rows, (request, last logits, new
        tokens) each, and its mass [rows, L] (None without one). ``prefill``: one request's prompt
        (after its cached prefix)."""
        if self.simulated:
            return self._simulate(req_ids, tokens)
        kv, device = self.kv, self.config.device
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
        # A prefill that stores prompt blocks also cuts its mass at their ends (prefix caching
        # keeps what a cached prefix's queries paid, see runtime/prefix_caching.py).
        cuts = kv.mass_cuts(req_ids[0]) if prefill and kv.needs_attention else []
        start = time.perf_counter()
        # Graphs captured without the mass serve no batch once a request's own policy needs it.
        if self.graphs is not None and longest == 1 and (self.graphs.return_mass or not kv.needs_attention):
            logits, mass = self.graphs.run(input_ids, positions, slots, valid)
        else:
            q_lens = torch.tensor([len(t) for t in tokens]).to(device)
            mass_cuts = torch.tensor([cuts + [len(tokens[0])]]) if cuts else None
            logits, mass = self.model(
                input_ids.to(device), positions.to(device), slots.to(device), q_lens,
                kv.cache, valid, return_mass=kv.needs_attention, logits_at=q_lens - 1,
                carry_mass=self.consistency.carry, mass_cuts=mass_cuts,
            )
        mass = self.consistency.reduce_mass(mass)  # every rank's heads: identical decisions
        # One device-to-host copy per forward for all rows (the policy reads each row on the host);
        # it also takes the graph's reused output buffers out of the way of the next replay.
        last = logits.float().cpu()
        mass = None if mass is None else mass.float().cpu()
        self.stats.forward_seconds += time.perf_counter() - start
        cut_mass = None
        if cuts:
            mass, cut_mass = mass[:, -1], mass[0, :-1]
        if prefill and mass is not None:
            mass = kv.prefill_mass(req_ids[0], mass[0], cut_mass)[None]
        rows = [(self.requests[r], last[i], len(row)) for i, (r, row) in enumerate(zip(req_ids, tokens))]
        return rows, None if mass is None else mass[: len(req_ids)]  # a graph's padding rows left out

    def _simulate(self, req_ids: list[int], tokens: list[list[int]]):
        """The simulated backend's forward: no model runs (token 1 always); the attention mass is
        computed at the step from the batch's token layout (``SimulatedModel.batch_mass``)."""
        self.kv.set_batch(req_ids)
        logits = torch.tensor([0.0, 1.0])
        return [(self.requests[r], logits, len(row)) for r, row in zip(req_ids, tokens)], None

    def _batch_mass(self, req_ids: list[int], masses: list, queries: list[int]):
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

    def _advance(self, request: Request, logits: torch.Tensor) -> RequestDelta:
        req_id, params = request.req_id, request.params
        if self.record_trace:
            request.logits.append(logits)
        token = sample(logits, params, self._generators.get(req_id, self._generator), request.output_ids)
        logprobs = torch.log_softmax(logits.float(), -1)
        request.cumulative_logprob += float(logprobs[token])
        if params.logprobs:
            request.logprobs.append(token_logprobs(logprobs, token, params.logprobs))
        request.output_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        reason = None
        if token in (params.stop_token_ids or ()):
            reason, request.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif request.remaining == 0:
            reason = "length"
        text = ""
        stream = self._texts.get(req_id)
        if stream is not None:
            ids = request.output_ids[:-1] if reason == "stop" else request.output_ids
            text, hit = stream.update(ids, final=reason is not None)
            request.text = stream.text
            if hit:
                reason, request.stop_reason = "stop", hit
        if reason is not None:
            self.running.remove(req_id)
            self.kv.release(req_id)
            self.stats.finished += 1
            self._finish(request, reason)
        return self._output(request, [token], text)

    def _finish(self, request: Request, reason: str) -> None:
        self._specs.pop(request.req_id, None)
        request.status = Status.FINISHED
        request.finish_reason = reason
        self._texts.pop(request.req_id, None)
        self._generators.pop(request.req_id, None)

    @staticmethod
    def _output(request: Request, new_ids: list[int], text: str) -> RequestDelta:
        new_logprobs = tuple(request.logprobs[-len(new_ids):]) if new_ids and request.logprobs else ()
        return RequestDelta(request.req_id, tuple(new_ids), text, request.status is Status.FINISHED,
                            request.finish_reason, len(request.output_ids), request.stop_reason,
                            request.cumulative_logprob, new_logprobs, request.num_preemptions)
