# SPDX-License-Identifier: Apache-2.0
"""vToken on the ``trtllm-build`` + Python runner path (TensorRT-LLM 1.2: ``ModelRunner`` over
``GenerationSession`` and its pure-Python block manager).

With a paged KV cache the session keeps blocks in Python (``runtime/kv_cache_manager.py``, one
``KVCacheManager`` per pool under ``memory_pools/pools_kv_cache_manager.py``) and, every step in
``handle_per_step``, runs the engine, calls the manager's ``step``, builds the next step's inputs
in ``_get_next_step_shape_buffer`` and binds them (``_set_tensors``; in CUDA-graph mode it then
re-captures the graph, so the new values are picked up). The session subclass built here does
vToken's step inside ``_get_next_step_shape_buffer``, after the engine wrote this step's tokens
and before anything is bound:

    sync      the token table learns the tokens the engine just wrote (the prompts at step 0,
              one per sequence after) and each sequence's block list
    policy    the policy marks tokens dead (score-free policies only: the engine exposes no
              attention probabilities)
    compact   dense plans, one copy for the batch, commit; the freed tail blocks go back to the
              block manager's free list
    shift     every surviving key of a shortened sequence is turned back by the tokens it lost
              (``reclaim/rerotate.py``): the GPT attention plugin's RoPE does not read
              ``position_ids``; it rotates each new token by its physical position,
              sequence_length - 1. A request
              gives tokens up a block at a time (``Budget.unit``), so a pass per block's worth;
              in a 16-bit pool each pass starts from the value the key was written with
              (``recover``), so roundings do not add up (test_engine_drift.py has the numbers)
    fit       each sequence holds exactly the blocks for its tokens plus the next one; the
              manager's length becomes the physical length + 1
    rewrite   kv_cache_block_offsets and its host twin from the block manager; sequence_length
              (physical + 1, a buffer of vToken's own: the decoder keeps the session's logical
              lengths for its outputs) and host_past_key_value_lengths (physical)

The pool is sized for the eviction budget instead of batch x max_seq_len, and a sequence may
generate past the engine's ``max_seq_len`` as long as its physical KV fits the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trtllm_vtoken.integration.trtllm.engine_config import check_pool, engine_rope
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.integration.trtllm.state import make_step, new_block_span
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.reclaim.rope import RopeSpec
from trtllm_vtoken.step import StepInput

SCORE_FREE_POLICIES = ("random", "sliding_window", "streaming_llm")


def check_engine_settings(settings: VTokenSettings) -> None:
    """Raises ValueError for settings the engine path cannot honour."""
    if settings.policy not in SCORE_FREE_POLICIES:
        raise ValueError(
            f"policy {settings.policy!r} needs attention probabilities, which a TensorRT engine does not "
            f"expose (the GPT attention plugin returns only its output): use one of {list(SCORE_FREE_POLICIES)}")
    if settings.positions != "shift":
        raise ValueError("the engine path needs positions='shift': the GPT attention plugin rotates each new "
                         "token by its physical position (sequence_length - 1), not by position_ids")


def physical_bound(settings: VTokenSettings, longest_prompt: int, max_new_tokens: int) -> int:
    """The most KV positions one sequence needs at once (its tokens plus the one being written)."""
    total = longest_prompt + max_new_tokens
    live = settings.make_policy().budget.target(total)
    return min(max(longest_prompt, live + 1), total)


class EngineVToken:
    """vToken's state for one ``decode``: the step (token tables, policy, dense compaction, key
    re-rotation) over the session's block manager.

    Args:
        pools: the session's KV pools [blocks, layers, 2, kv_heads, tokens_per_block, head_dim].
    """

    def __init__(self, settings: VTokenSettings, rope: RopeSpec, pools: Sequence[torch.Tensor],
                 tokens_per_block: int) -> None:
        check_engine_settings(settings)
        if len(pools) != 1:
            raise ValueError(f"engines with {len(pools)} KV pools (layers with different KV head counts) "
                             "are not supported")
        check_pool(pools[0])
        self.tokens_per_block = tokens_per_block
        # 16-bit pools: each pass turns a key from the value it was written with (rerotate.py), so
        # roundings do not add up over the passes a long-lived key (a sink) goes through.
        self.rerotation = KeyRerotation(pools, rope, recover=pools[0].element_size() == 2)
        self.step = make_step(settings, tokens_per_block, pools[0].shape[0], pools, self.rerotation)
        self.blocks_trimmed = 0
        self.peak_blocks = 0

    def run(self, pools_manager: Any, written: Sequence[int], window: int, stream: Any = None) -> list[int]:
        """vToken's work after the engine wrote ``written[b]`` tokens of each sequence b: one step
        for the batch. Leaves the manager's block lists and lengths physical; returns each
        sequence's physical length. RuntimeError if a sequence would need more than ``window``
        positions.

        A sequence's block list in the session's manager, around the step::

            before   [ table's blocks | new blocks of the written tokens | allocated ahead ]
                                       `-- fresh: the step learns them --'   (the next token's
                                                                             block, or at the
                                                                             first step the
                                                                             longest prompt's)
            after    [ table's blocks (the tail the step freed released) | allocated ahead ]
                     then cut or grown to the blocks of kv_len + 1 tokens (the next token's slot)
        """
        manager = pools_manager.get_single_kv_cache_manager()
        blocks, step, tpb = manager.blocks_manager, self.step, self.tokens_per_block
        owners = {seq.get_batch_idx(): seq for seq in manager.sequences}
        fresh, needed = [], {}
        for b, seq in owners.items():
            if b not in step:
                step.add_request(b)
            held = blocks.allocated_blocks[seq][0]
            span = new_block_span(step, b, written[b])
            needed[b] = span.stop
            if len(held) < needed[b]:
                raise RuntimeError(f"sequence {b}: the session holds {len(held)} blocks for {needed[b]} blocks of KV")
            fresh.append([block.idx for block in held[span]])
        req_ids = list(owners)
        step.run(StepInput.of_lists(req_ids, [written[b] for b in req_ids], fresh, stream=stream))
        lengths = []
        for b, seq in owners.items():
            kv_len = step.kv_len(b)
            if kv_len + 1 > window:
                raise RuntimeError(f"sequence {b} needs {kv_len + 1} KV positions, more than the attention window "
                                   f"{window}: use a budget whose physical bound fits the engine")
            held = blocks.allocated_blocks[seq][0]
            self._release(blocks, held, held[step.num_blocks(b) : needed[b]])  # counted by the step
            next_blocks = kv_len // tpb + 1  # up to the next token's slot
            self.blocks_trimmed += self._release(blocks, held, held[next_blocks:])
            while len(held) < next_blocks:
                blocks.allocate(seq)
            manager.lens[b] = kv_len + 1
            if [block.idx for block in held[: step.num_blocks(b)]] != step.block_ids(b):
                raise RuntimeError(f"sequence {b}: the block manager and the token table disagree on its blocks")
            lengths.append(kv_len)
        self.peak_blocks = max(self.peak_blocks, blocks.num_blocks - len(blocks.free_blocks))
        return lengths

    @staticmethod
    def _release(blocks: Any, held: list, victims: Sequence[Any]) -> int:
        """Takes ``victims`` out of a sequence's block list ``held`` and returns them to the free
        list (as ``BlocksManager.free`` does for a whole sequence: unlink, free when no one else
        holds it); how many it released."""
        victims = list(victims)
        for block in victims:
            held.remove(block)
            block.remove_link()
            if not block.has_link():
                blocks.free_blocks.append(block)
        return len(victims)

    def stats(self) -> dict[str, int]:
        """``blocks_freed``: blocks compaction emptied; ``blocks_trimmed``: blocks the session had
        allocated beyond a sequence's need (every sequence gets the longest prompt's at the start)."""
        stats = self.step.stats
        return {"tokens_evicted": stats.tokens_evicted, "moves": stats.moves, "blocks_freed": stats.blocks_freed,
                "blocks_trimmed": self.blocks_trimmed, "peak_blocks": self.peak_blocks,
                "keys_rerotated": self.rerotation.stats.tokens, "rerotation_passes": self.rerotation.stats.passes}


def build_session_class(base: type) -> type:
    """``VTokenGenerationSession`` over ``base`` (TensorRT-LLM's ``GenerationSession``)."""

    class VTokenGenerationSession(base):
        vtoken_session = True
        vtoken_settings: VTokenSettings
        vtoken_rope: RopeSpec
        vtoken: EngineVToken | None = None

        def _get_num_paged_blocks(self, max_attention_window_size, sink_token_length):
            """Blocks per sequence for the physical bound (the runner passes it as the attention
            window, so the pool is batch x the bound's blocks, not batch x max_seq_len's)."""
            if sink_token_length:
                raise ValueError("vToken runs StreamingLLM as a policy: leave sink_token_length unset")
            per_seq = math.ceil(max_attention_window_size / self.tokens_per_block)
            return self.batch_size * self.beam_width * per_seq, per_seq

        def setup(self, *args, **kwargs):
            out = super().setup(*args, **kwargs)
            if self.beam_width != 1:
                raise ValueError("vToken needs beam width 1")
            allocator = getattr(self, "_memory_pool_allocator", None)
            if allocator is None or not hasattr(allocator, "_pool_pointers"):
                raise RuntimeError("this GenerationSession has no MemoryPoolsAllocator pools: vToken targets "
                                   "TensorRT-LLM 1.2 with paged_kv_cache")
            self.vtoken = EngineVToken(self.vtoken_settings, self.vtoken_rope, allocator._pool_pointers,
                                       self.tokens_per_block)
            self._vtoken_lengths = torch.ones(self.batch_size, dtype=torch.int32, device=self.device)
            return out

        def _get_next_step_shape_buffer(self, batch_size, beam_width, max_context_length, step, context_lengths,
                                        host_context_lengths, position_ids, last_token_ids, attention_mask,
                                        cross_attention_mask, cache_indirection, kv_cache_block_offsets,
                                        host_kv_cache_block_offsets, *args, **kwargs):
            written = host_context_lengths.tolist() if step == 0 else [1] * batch_size
            stream = torch.cuda.current_stream() if self.vtoken.step.executor.device.type == "cuda" else None
            lengths = self.vtoken.run(self.pools_kv_cache_manager, written, self.max_attention_window_size, stream)
            host_offsets = self.pools_kv_cache_manager.get_block_offsets(beam_width)
            offsets = host_offsets.to(kv_cache_block_offsets.device)
            tensors = super()._get_next_step_shape_buffer(
                batch_size, beam_width, max_context_length, step, context_lengths, host_context_lengths,
                position_ids, last_token_ids, attention_mask, cross_attention_mask, cache_indirection, offsets,
                host_offsets, *args, **kwargs)
            physical = torch.tensor(lengths, dtype=torch.int32)
            self._vtoken_lengths.copy_(physical + 1)  # in place: a captured graph keeps its address
            runtime_tensor = type(tensors["sequence_length"])
            tensors["sequence_length"] = runtime_tensor.from_torch(
                "sequence_length", self._vtoken_lengths, override_shape=(batch_size,))
            tensors["host_past_key_value_lengths"] = runtime_tensor.from_torch("host_past_key_value_lengths", physical)
            return tensors

    VTokenGenerationSession.__qualname__ = f"VTokenGenerationSession[{base.__name__}]"
    return VTokenGenerationSession


class VTokenEngineRunner:
    """A ``tensorrt_llm.runtime.ModelRunner`` whose session runs vToken every step.

    Args:
        runner: a ModelRunner built by ``ModelRunner.from_dir`` (its session keeps its engine and
            buffers; only its class gains vToken's overrides).
        settings: score-free policy, dense mode, ``positions="shift"`` (``check_engine_settings``).
        rope: the engine's RoPE (``RopeSpec.from_trtllm_config``); non-shiftable RoPE is refused.
    """

    def __init__(self, runner: Any, settings: VTokenSettings, rope: RopeSpec) -> None:
        check_engine_settings(settings)
        self.runner, self.settings, self.rope = runner, settings, rope
        self.engine_max_seq_len = runner.max_seq_len
        session = runner.session
        if not getattr(session, "vtoken_session", False):  # wrapped once; new settings replace old
            session.__class__ = build_session_class(type(session))
        session.vtoken_settings, session.vtoken_rope = settings, rope

    @classmethod
    def from_dir(cls, engine_dir: str | Path, settings: VTokenSettings | None = None,
                 **kwargs: Any) -> VTokenEngineRunner:
        """Loads a ``trtllm-build`` engine (RuntimeError without tensorrt_llm)."""
        try:
            from tensorrt_llm.runtime import ModelRunner
        except ImportError as exc:
            raise RuntimeError(f"tensorrt_llm is not importable: {exc}") from None
        settings = settings or VTokenSettings(policy="streaming_llm", positions="shift")
        return cls(ModelRunner.from_dir(str(engine_dir), **kwargs), settings, engine_rope(engine_dir))

    def generate(self, batch_input_ids: Sequence[torch.Tensor], max_new_tokens: int, **kwargs: Any):
        """``ModelRunner.generate`` with the attention window set to the physical bound, so a
        sequence may run past the engine's max_seq_len. ValueError if the bound exceeds it."""
        longest = max(len(ids) for ids in batch_input_ids)
        bound = physical_bound(self.settings, longest, max_new_tokens)
        if bound > self.engine_max_seq_len:
            raise ValueError(f"a sequence needs {bound} KV positions at once, more than the engine's max_seq_len "
                             f"{self.engine_max_seq_len}: lower the budget or max_new_tokens")
        self.runner.max_seq_len = max(self.engine_max_seq_len, longest + max_new_tokens)  # logical lengths
        try:
            return self.runner.generate(batch_input_ids, max_new_tokens=max_new_tokens,
                                        max_attention_window_size=bound, **kwargs)
        finally:
            self.runner.max_seq_len = self.engine_max_seq_len

    def stats(self) -> dict[str, int]:
        """vToken's counters for the last ``generate``."""
        vtoken = self.runner.session.vtoken
        return vtoken.stats() if vtoken is not None else {}
