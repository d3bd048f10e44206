# SPDX-License-Identifier: Apache-2.0
"""The one batched vToken step every host calls per decode iteration (``DecodeStep``).

One decode step, top to bottom, each stage one module:

    DecodeStep.start(StepInput)                                  step.py
      0. repeat    with the call on the worker, the last call     beside.py        (C++ core, overlap)
                   started again for the same lists, and done
      1. batch     the input checked, before anything changes     iteration.py     (Iteration)
      2. decision  the C++ call decides a batch of one natively   decide.py        (Decision)
                   decided policy (or none) itself; else the
                   victims are decided here in Python (the batch
                   registered first, slots.py), policies' select
      3. call      register, evict, token table (append, evict,
                   plan, commit), layout, output; one of two
                   implementations of the same call:
                     C++:    one native call, at once             fused.py   -> cpp/core/decode_step.h
                             or on the step's worker              beside.py  -> fused.py
                     Python: its specification                    spec.py    -> reclaim/step_batch.py
      4. background  lazy background compaction: the plans       background.py
                   whose copies finished commit, the new plans'
                   copy starts
      5. end       ONE copy of every move (I3), the invariant     end.py  (reclaim/copy.py, checks.py,
                   checks, the re-rotation, the counters                   reclaim/rerotate.py)
    DecodeStep.finish() -> StepOutput                             io.py

What serves them: ``slots.py`` the batch layout (per slot: live id, statistics; per request: a
block row and counters), ``core.py`` the token table (C++ or Python) and the hosts' queries of it,
``config.py`` the settings and counters, ``requests.py`` / ``queries.py`` requests joining and
leaving and what hosts read between steps.

Which host runs what: the reference engine and the simulated backend (``runtime/kv_manager.py``,
``runtime/engine_step.py``) start the step beside the next iteration's forward and finish it
before sampling that forward (the overlap scheduler, ``forward_between``: the copy waits for
``finish``), or in the plain order before sampling and finish it after (the C++ call on the
worker meanwhile, ``EngineConfig.step_overlap``), lazy mode with background compaction by
default; the TensorRT-LLM manager (``integration/trtllm/state.py``) and the engine-path runner
(``integration/trtllm/engine_runner.py``) run it at once, dense. Each takes the C++ core where it
is built (``vtoken info`` names it), the Python specification otherwise or when asked
(``step_impl="python"``); the decision is the call's own for H2O, StreamingLLM, sliding window or
no policy, made in Python for Random, Scissorhands and batches mixing policies.
"""

from __future__ import annotations

from trtllm_vtoken.step.config import StepConfig, StepStats
from trtllm_vtoken.step.core import resolve_impl
from trtllm_vtoken.step.io import StepInput, StepOutput
from trtllm_vtoken.step.requests import DEFAULT
from trtllm_vtoken.step.step import DecodeStep

__all__ = ["DEFAULT", "DecodeStep", "StepConfig", "StepInput", "StepOutput", "StepStats", "resolve_impl"]
