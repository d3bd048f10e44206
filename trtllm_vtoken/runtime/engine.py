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

1-2 are the scheduler's (``runtime/scheduler.py``), 3 the forwards' (``runtime/forward.py``). With
the overlap scheduler (``EngineConfig.overlap_scheduler``, the default; ``runtime/overlap.py``) the
step of 5 waits for the next iteration: it starts once that iteration's first forward has its
tables, runs beside it, and ends before its sampling.

A request that could never fit (too long for ``max_seq_len`` or for the whole pool) is refused by
``add_request`` with a ValueError; everything else eventually runs to completion, but for a
request preempted (greedy admission) whose recomputation no longer fits: it ends with "length".
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import numpy as np
import torch

from trtllm_vtoken.consistency import RankConsistency, RankGroup, SingleRank
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine_sampling import RequestSampling
from trtllm_vtoken.runtime.engine_stats import EngineStats
from trtllm_vtoken.runtime.forward import Forwards
from trtllm_vtoken.runtime.kv_manager import KVCacheManager
from trtllm_vtoken.runtime.model import LlamaForCausalLM
from trtllm_vtoken.runtime.overlap import DeferredStep, OverlapIteration
from trtllm_vtoken.runtime.parallel.layers import check_shard
from trtllm_vtoken.runtime.request import Request, RequestDelta, Status
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.scheduler import Scheduler
from trtllm_vtoken.runtime.speculation import Speculation
from trtllm_vtoken.runtime.tokenizer import StreamText, Tokenizer


class Engine(OverlapIteration, RequestSampling):
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
        if self.simulated and self.config.batch_invariant:
            raise ValueError("batch_invariant needs a model: the simulated backend runs no products")
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
        self.forwards = Forwards(self.model, self.kv, self.graphs, self.consistency, self.stats, self.config.device,
                                 self.config.max_batch_size,
                                 self.config.max_blocks_per_seq * self.config.tokens_per_block,
                                 batch_invariant=self.config.batch_invariant)
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
        self.scheduler = Scheduler(self.requests, self.waiting, self.running, self.kv, self._specs,
                                   self.config.max_batch_size, self.stats)
        spec = self.config.speculative_config
        self.speculation = Speculation(spec, self.requests, self.kv) if spec is not None else None
        """Speculative decoding's drafts and acceptance (None: one token a step)."""
        self._deferred: DeferredStep | None = None  # overlap scheduler: rows waiting for their step
        self._layout_now: np.ndarray | None = None  # this iteration's layout as its forwards see it (logical ids)
        self._stepped: list[int] = []
        self._checked_steps = 0  # steps the ranks compared (the overlap scheduler's first iteration runs none)

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
        drafts = self._check_runnable(len(prompt_ids), params.max_tokens, spec,
                                      self.config.draft_tokens_per_row if params.greedy else 0)
        req_id = next(self._ids) if req_id is None else req_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id} is already in use")
        self.requests[req_id] = Request(req_id, prompt_ids, params, arrival=time.perf_counter(), draft_tokens=drafts)
        self._specs[req_id] = spec
        name = "native" if spec is None else spec.name
        self.stats.requests_by_policy[name] = self.stats.requests_by_policy.get(name, 0) + 1
        if self.tokenizer is not None:
            self._texts[req_id] = StreamText(self.tokenizer, params.stop or ())
        if params.seed is not None:
            self._generators[req_id] = torch.Generator().manual_seed(params.seed)
        self.waiting.append(req_id)
        return req_id

    def _check_runnable(self, prefill_len: int, max_tokens: int, spec, drafts: int = 0) -> int:
        """The draft tokens a request prefilling ``prefill_len`` tokens may carry per decode step
        (``KVCacheManager.check_fits_alone``); ValueError if it could never run, in the pool or
        (without chunked prefill) in ``max_num_tokens``."""
        cfg = self.config
        if cfg.max_num_tokens is not None and not cfg.enable_chunked_prefill and prefill_len > cfg.max_num_tokens:
            raise ValueError(f"prompt ({prefill_len} tokens) exceeds max_num_tokens {cfg.max_num_tokens}: "
                             "enable chunked prefill to run it over several iterations")
        return self.kv.check_fits_alone(prefill_len, max_tokens, spec, drafts)

    def cancel(self, req_id: int) -> bool:
        """Stops a request and frees its blocks now; False if it had already finished."""
        request = self.requests.get(req_id)
        if request is None or request.status is Status.FINISHED:
            return False
        if request.status is Status.RUNNING:
            self.running.remove(req_id)
            self.kv.release(req_id)
            self.scheduler.forget(req_id)
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
        decode = self.scheduler.schedule_decode()
        # Draft tokens count in the iteration's tokens before the prompts' (TensorRT-LLM's
        # micro-batch scheduler counts a decode row's drafts with it, then fits the context chunks).
        drafts = None if self.speculation is None else self.speculation.draft(decode)
        prefill = self.scheduler.schedule_prefill(len(decode) + sum(map(len, (drafts or {}).values())))
        if not self.running and self.waiting:
            self._end_unrunnable(reported)
        if self.config.overlap_scheduler:
            return self._step_overlapped(reported, decode, prefill)
        results, masses = self._run_forwards(decode, prefill, drafts)
        self.forwards.wait()  # the step reads the forwards' attention
        # One step for every row the forwards ran, begun before sampling: its new tokens join the
        # table, the policy decides for the whole batch (a request's cached chain is cut before
        # its KV can move), one copy relocates every request's KV. Its native call runs beside the
        # sampling where it can (``EngineConfig.step_overlap``); a request that finishes now leaves
        # after it. Then admission learns what each request going on holds, and the prefix cache
        # keys the blocks that filled.
        rows = [request.req_id for request, *_ in results]
        self.kv.start_step(rows, self.forwards.batch_mass(rows, masses, [r[2] for r in results]),
                           overlap=self.config.step_overlap, prompt_goes_on=bool(self.scheduler.prefilling))
        for request, logits, _ in results:
            if logits is not None:  # None: a prompt's chunk before its last
                reported.append(self._advance(request, logits))
        self._end_step(rows, self.kv.finish_step(), reported)
        return reported

    def _end_unrunnable(self, reported: list[RequestDelta]) -> None:
        """Nothing runs and the first waiting request was not admitted: if it can never run (a
        request preempted and recomputed prefills its output too, all of it before its policy
        evicts: more than the whole pool, or than ``max_num_tokens`` without chunked prefill),
        it ends with finish reason "length" and what it generated so far, instead of waiting for
        ever. ``add_request`` refuses every request that could not run when it arrived."""
        request = self.requests[self.waiting[0]]
        try:
            self._check_runnable(len(request.prefill_ids()), request.remaining, self._specs[request.req_id])
            return
        except ValueError:
            pass
        self.waiting.popleft()
        text, stream = "", self._texts.get(request.req_id)
        if stream is not None:  # the text held back for a stop string or a partial character
            text, _ = stream.update(request.output_ids, final=True)
            request.text = stream.text
        self.stats.finished += 1
        self._finish(request, "length")
        reported.append(self._output(request, [], text))

    def _run_forwards(self, decode: list[int], prefill: list[int], drafts: dict[int, list[int]] | None = None):
        """This iteration's forwards: the decode rows at once (with their ``drafts``, speculative
        decoding), each prefill on its own. Returns their rows (request, last logits, new tokens)
        and each forward's mass."""
        results: list[tuple[Request, torch.Tensor, int]] = []
        masses: list[torch.Tensor | None] = []  # each forward's [rows, L], its rows in results in order
        if decode:
            if drafts:
                tokens = [[self.requests[r].pending, *drafts.get(r, ())] for r in decode]
                logits, mass = self.forwards.run(decode, tokens, verify=True)
                # the tokens each row keeps: their logits, how many the step takes in, their mass
                kept, taken, mass = self.speculation.accept(decode, drafts, logits, mass)
                results += [(self.requests[r], kept[i], taken[i]) for i, r in enumerate(decode)]
                self.stats.decode_tokens += sum(taken)
            else:
                logits, mass = self.forwards.run(decode, [[self.requests[r].pending] for r in decode])
                results += [(self.requests[r], logits[i], 1) for i, r in enumerate(decode)]
                self.stats.decode_tokens += len(decode)
            masses.append(mass)
        for req_id in prefill:
            first, end, cached = self.scheduler.chunks.pop(req_id)
            prompt = self.requests[req_id].prefill_ids()
            ids = prompt[first:end]  # a cached prefix is not recomputed; with chunked prefill, one chunk
            logits, mass = self.forwards.run([req_id], [ids], prefill=True, prompt_after=len(prompt) - end,
                                             first_prefill=first == cached)
            results.append((self.requests[req_id], logits[0] if end == len(prompt) else None, len(ids)))
            masses.append(mass)
            self.stats.prefill_tokens += len(ids)
            self.stats.cached_prompt_tokens += cached
        return results, masses

    def _end_step(self, rows: list[int], out, reported: list[RequestDelta], stepped: bool = True,
                  iteration: bool = True) -> None:
        """After a step of ``rows``: the eviction trace, admission, the prefix cache's keys and the
        ranks' comparison, for the requests still running. ``iteration``: the iteration's last step
        (the overlap scheduler's count-based rows take a step of their own before it)."""
        continuing = [r for r in rows if self.requests[r].status is Status.RUNNING]
        if self.record_trace:
            for i, req_id in enumerate(rows):
                if self.requests[req_id].status is Status.RUNNING:
                    self.requests[req_id].evictions.append(tuple(out.victims_of(i)) if out is not None else ())
        self.kv.update(continuing, [self.requests[r].remaining for r in continuing],
                       [self.scheduler.unprefilled(r) for r in continuing] if self.scheduler.prefilling else None)
        self.kv.store_written(continuing, lambda r: self.requests[r].prefill_ids())
        if self.config.check_invariants and stepped:  # every rank: same table, same free blocks, same tokens
            sampled = [t for out in reported for t in (out.req_id, *out.new_token_ids)]
            self.consistency.check(self._checked_steps, self.kv.layout, [self.kv.pool.num_free, *sampled])
            self._checked_steps += 1
        self.stats.steps += iteration
