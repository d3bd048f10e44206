# SPDX-License-Identifier: Apache-2.0
"""``LLM``: load a model folder (or the embedded default) and generate, as TensorRT-LLM's LLM API
does: the same prompt forms (``runtime/prompts.py``), ``SamplingParams`` fields
(``runtime/sampling.py``) and results (``runtime/outputs.py``).

    llm = LLM(variant="vtoken", policy="h2o", budget=0.5)
    out = llm.generate("What is the capital of France?", SamplingParams(max_tokens=32))
    out.outputs[0].text  ->  "The capital of France is Paris. ..."
    outs = llm.generate(["prompt a", [1, 2, 3]])       # a batch: one RequestOutput per prompt

With ``tensor_parallel_size=N`` (N > 1) the model runs in N rank processes (``runtime/parallel``)
and this object only sends them work: ``engine`` is None and ``last_reports`` holds each rank's
report of the latest call. Create such an LLM under ``if __name__ == "__main__":`` (the ranks
are spawned and re-run the script; ``parallel/main_guard.py`` refuses otherwise); it stops its
ranks on ``close()``, at the end of a ``with`` block, or when the interpreter exits.

The process's intra-op CPU threads are set here: ``threads``, or the cores this process may use
but one (``trtllm_vtoken/threads.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from trtllm_vtoken.deprecation import warn_deprecated
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.outputs import OutputStream, RequestOutput, finished_output
from trtllm_vtoken.runtime.prompts import Prompt, parse_prompts
from trtllm_vtoken.runtime.sampling import SamplingParams

RENAMED = {"params": "sampling_params", "progress": "use_tqdm"}
"""Keywords of the previous release -> TensorRT-LLM's names."""


class LLM:
    """Owns a model, its tokenizer and one engine (or the rank processes running them).

    Args:
        model: A Hugging Face Llama folder (config.json, safetensors, tokenizer), or None / the
            default's name for SmolLM2-135M-Instruct, converted on first use.
        config: Engine settings; ``**overrides`` replace single fields (unknown ones: ValueError).
        threads: Intra-op CPU threads of this process (of each rank under tensor parallelism);
            None: chosen from the cores the process may use.
    """

    def __init__(self, model: str | os.PathLike | None = None, config: EngineConfig | None = None, *,
                 threads: int | None = None, **overrides: Any) -> None:
        from trtllm_vtoken.runtime.checkpoint import resolve_model
        from trtllm_vtoken.runtime.engine import Engine
        from trtllm_vtoken.runtime.model import load_llama
        from trtllm_vtoken.runtime.tokenizer import Tokenizer
        from trtllm_vtoken.threads import set_threads

        if overrides:
            base = vars(config) if config else {}
            config = EngineConfig.from_dict({**base, **overrides})
        self._config = config or EngineConfig()
        self.engine: Engine | None = None
        self.ranks = None
        self.last_reports: list = []
        if self._config.tensor_parallel_size > 1:
            from trtllm_vtoken.runtime.parallel.main_guard import check_main_guard

            check_main_guard()  # before the model loads: a refused script fails at once
        self.model_path = resolve_model(model)
        self.tokenizer = Tokenizer(self.model_path)
        if self._config.tensor_parallel_size > 1:
            from trtllm_vtoken.runtime.model import LlamaConfig
            from trtllm_vtoken.runtime.parallel.launch import RankProcesses
            from trtllm_vtoken.runtime.parallel.partition import TensorParallelPlan

            # ValueError before any rank starts (a split the model does not allow)
            TensorParallelPlan.for_model(LlamaConfig.from_hf(self.model_path / "config.json"),
                                         self._config.tensor_parallel_size)
            self.ranks = RankProcesses(self.model_path, self._config.tensor_parallel_size, self._config.device,
                                       threads)
        else:
            set_threads(threads)
            self.engine = Engine(load_llama(self.model_path), self._config, self.tokenizer)

    @property
    def config(self) -> EngineConfig:
        return self._config

    def close(self) -> None:
        """Stops the rank processes (tensor_parallel_size > 1); a no-op otherwise. Idempotent."""
        if self.ranks is not None:
            self.ranks.close()

    shutdown = close  # TensorRT-LLM's name

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: str | Sequence[int] | Prompt, chat: bool = True) -> list[int]:
        """Token ids for a prompt: text goes through the chat template (if ``chat``); ids pass."""
        if isinstance(prompt, Prompt):
            prompt = prompt.text if prompt.text is not None else prompt.token_ids
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, chat=chat)
        return [int(t) for t in prompt]

    def generate(self, inputs: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, *, chat: bool = True, **renamed: Any) -> RequestOutput | list[RequestOutput]:
        """Runs the prompts to completion, batched continuously. One prompt (a str, a list of int,
        a prompt dict) gives one ``RequestOutput``; a list of prompts a list, in prompt order.
        ``sampling_params``: one for all prompts, or one per prompt (each may carry its own
        eviction). ``chat``: wrap text prompts in the model's chat template."""
        sampling_params, use_tqdm = _renamed(renamed, sampling_params, use_tqdm)
        prompts, batched = parse_prompts(inputs)
        shared = not isinstance(sampling_params, Sequence)
        per_prompt = [sampling_params] * len(prompts) if shared else list(sampling_params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        per_prompt = [p or SamplingParams() for p in per_prompt]
        ids = [self.encode(p, chat) for p in prompts]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        if self.ranks is not None:
            results = self._generate_on_ranks(ids, per_prompt, bar)
        else:
            engine = self.engine
            req_ids = [engine.add_request(p, q) for p, q in zip(ids, per_prompt)]
            while engine.has_unfinished():
                done = sum(o.finished for o in engine.step())
                if bar is not None:
                    bar.update(done)
            results = [finished_output(engine.pop_finished(i), None) for i in req_ids]
        if bar is not None:
            bar.close()
        outputs = [replace(r, prompt=p.text) for r, p in zip(results, prompts)]
        return outputs if batched else outputs[0]

    def stream(self, inputs: Any, sampling_params: SamplingParams | None = None, *, chat: bool = True,
               **renamed: Any) -> Iterator[RequestOutput]:
        """Yields one prompt's output as it grows: after every step that adds to it, the whole
        ``RequestOutput`` so far, ``outputs[0].text_diff`` / ``token_ids_diff`` / ``logprobs_diff``
        holding what the step added; the last has ``finished`` True. Other requests may share the
        batch; their outputs are kept for them.

        A caller that stops early (``break``, ``close()``, or dropping the generator) ends the
        request: it is cancelled and leaves the engine with its blocks when the generator closes
        (under tensor parallelism the ranks finish the job and the rest is dropped).
        """
        sampling_params, _ = _renamed(renamed, sampling_params, False)
        prompts, batched = parse_prompts(inputs)
        if batched:
            raise TypeError("stream() takes one prompt (a str, a list of int or a prompt dict), not a batch")
        ids = self.encode(prompts[0], chat)
        params = sampling_params or SamplingParams()
        if self.ranks is not None:
            yield from self._stream_on_ranks(ids, params, prompts[0].text)
            return
        engine = self.engine
        req_id = engine.add_request(ids, params)
        snapshots = OutputStream(req_id, prompts[0].text, ids)
        try:
            while True:
                for delta in engine.step():
                    if delta.req_id == req_id and (delta.new_token_ids or delta.text_delta or delta.finished):
                        yield snapshots.update(delta)
                if engine.requests[req_id].finish_reason is not None:
                    break
        finally:  # also on GeneratorExit, raised at the yield when the caller closes the generator
            engine.cancel(req_id)
            engine.pop_finished(req_id)

    # ---- tensor parallelism: the ranks run the job, rank 0 reports -----------------------------
    def _job(self, prompts: list[list[int]], params: list[SamplingParams], stream: bool):
        from trtllm_vtoken.runtime.parallel.rank_process import Job

        return Job(self._config, prompts, params, stream=stream)

    def _generate_on_ranks(self, prompts: list[list[int]], params: list[SamplingParams], bar) -> list[RequestOutput]:
        on_step = (lambda deltas: bar.update(sum(d.finished for d in deltas))) if bar is not None else None
        self.last_reports = self.ranks.run(self._job(prompts, params, stream=bar is not None), on_step)
        lead = self.last_reports[0]
        return [lead.results[i] for i in range(len(prompts))]

    def _stream_on_ranks(self, prompt: list[int], params: SamplingParams, text: str | None) -> Iterator[RequestOutput]:
        """The ranks cannot leave a job alone: stopping early lets it finish and drops the rest."""
        events = self.ranks.events(self._job([prompt], [params], stream=True))
        snapshots = OutputStream(0, text, prompt)
        try:
            for kind, item in events:
                if kind == "done":
                    self.last_reports = item
                for delta in item if kind == "step" else []:
                    if delta.new_token_ids or delta.text_delta or delta.finished:
                        yield snapshots.update(delta)
        finally:
            for kind, item in events:
                if kind == "done":
                    self.last_reports = item


def _renamed(renamed: dict[str, Any], sampling_params: Any, use_tqdm: bool) -> tuple[Any, bool]:
    """The previous release's keywords (``params``, ``progress``), with a warning each; any other
    unknown keyword is a TypeError."""
    unknown = sorted(set(renamed) - set(RENAMED))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}")
    for old, new in RENAMED.items():
        if old in renamed:
            warn_deprecated(f"the keyword {old}=", f"{new}=", stacklevel=4)
    return renamed.get("params", sampling_params), renamed.get("progress", use_tqdm)
