# SPDX-License-Identifier: Apache-2.0
"""``LLM``: load a model folder (or the embedded default) and generate, like TensorRT-LLM's LLM API.

    llm = LLM(variant="vtoken", policy="h2o", budget=0.5)
    [out] = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=32))
    out.text  ->  "The capital of France is Paris. ..."

With ``tensor_parallel_size=N`` (N > 1) the model runs in N rank processes (``runtime/parallel``)
and this object only sends them work: ``engine`` is None and ``last_reports`` holds each rank's
report of the latest call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class CompletionOutput:
    req_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_preemptions: int


class LLM:
    """Owns a model, its tokenizer and one engine.

    Args:
        model: A Hugging Face Llama folder (config.json, safetensors, tokenizer), or None / the
            default's name for SmolLM2-135M-Instruct, converted on first use.
        config: Engine settings; ``**overrides`` replace single fields (unknown ones: ValueError).
    """

    def __init__(self, model: str | os.PathLike | None = None, config: EngineConfig | None = None,
                 **overrides: Any) -> None:
        from trtllm_vtoken.runtime.checkpoint import resolve_model
        from trtllm_vtoken.runtime.engine import Engine
        from trtllm_vtoken.runtime.model import load_llama
        from trtllm_vtoken.runtime.tokenizer import Tokenizer

        if overrides:
            base = vars(config) if config else {}
            config = EngineConfig.from_dict({**base, **overrides})
        self._config = config or EngineConfig()
        self.model_path = resolve_model(model)
        self.tokenizer = Tokenizer(self.model_path)
        self.engine: Engine | None = None
        self.ranks = None
        self.last_reports: list = []
        if self._config.tensor_parallel_size > 1:
            from trtllm_vtoken.runtime.parallel.launch import RankProcesses

            self.ranks = RankProcesses(self.model_path, self._config.tensor_parallel_size, self._config.device)
        else:
            self.engine = Engine(load_llama(self.model_path), self._config, self.tokenizer)

    @property
    def config(self) -> EngineConfig:
        return self._config

    def close(self) -> None:
        """Stops the rank processes (tensor_parallel_size > 1); a no-op otherwise."""
        if self.ranks is not None:
            self.ranks.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """Token ids for a prompt: text goes through the chat template (if ``chat``); ids pass."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, chat=chat)
        return [int(t) for t in prompt]

    def generate(self, prompts: str | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = True, progress: bool = False) -> list[CompletionOutput]:
        """Runs all prompts to completion, batched continuously; outputs in prompt order.
        ``params``: one for all prompts, or one per prompt (each may carry its own eviction)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        if self.ranks is not None:
            return self._generate_on_ranks([self.encode(p, chat) for p in prompts],
                                           [q or SamplingParams() for q in per_prompt], progress)
        engine = self.engine
        ids = [engine.add_request(self.encode(p, chat), q) for p, q in zip(prompts, per_prompt)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while engine.has_unfinished():
            done = sum(o.finished for o in engine.step())
            if bar is not None:
                bar.update(done)
        if bar is not None:
            bar.close()
        return [self._completion(engine.pop_finished(i)) for i in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               chat: bool = True) -> Iterator[str]:
        """Yields text pieces of one prompt as they are generated (other requests may share the
        batch; their outputs are kept for them).

        A caller that stops early (``break``, ``close()``, or dropping the generator) ends the
        request: it is cancelled and leaves the engine with its blocks when the generator closes
        (under tensor parallelism the ranks finish the job and the rest is dropped).
        """
        if self.ranks is not None:
            yield from self._stream_on_ranks(self.encode(prompt, chat), params)
            return
        engine = self.engine
        req_id = engine.add_request(self.encode(prompt, chat), params)
        try:
            while True:
                for out in engine.step():
                    if out.req_id == req_id and out.text_delta:
                        yield out.text_delta
                if engine.requests[req_id].finish_reason is not None:
                    break
        finally:  # also on GeneratorExit, raised at the yield when the caller closes the generator
            engine.cancel(req_id)
            engine.pop_finished(req_id)

    # ---- tensor parallelism: the ranks run the job, rank 0 reports -----------------------------
    def _job(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None, stream: bool):
        from trtllm_vtoken.runtime.parallel.rank_process import Job

        return Job(self._config, prompts, params or SamplingParams(), stream=stream)

    def _generate_on_ranks(self, prompts: list[list[int]], params, progress: bool) -> list[CompletionOutput]:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        on_step = (lambda outs: bar.update(sum(o.finished for o in outs))) if bar else None
        self.last_reports = self.ranks.run(self._job(prompts, params, stream=bar is not None), on_step)
        if bar is not None:
            bar.close()
        lead = self.last_reports[0]
        return [CompletionOutput(i, prompt, lead.outputs[i], lead.texts[i], lead.finish_reasons[i],
                                 lead.preemptions[i]) for i, prompt in enumerate(prompts)]

    def _stream_on_ranks(self, prompt: list[int], params) -> Iterator[str]:
        """The ranks cannot leave a job alone: stopping early lets it finish and drops the rest."""
        events = self.ranks.events(self._job([prompt], params, stream=True))
        try:
            for kind, item in events:
                if kind == "done":
                    self.last_reports = item
                for out in item if kind == "step" else []:
                    if out.text_delta:
                        yield out.text_delta
        finally:
            for kind, item in events:
                if kind == "done":
                    self.last_reports = item

    @staticmethod
    def _completion(request) -> CompletionOutput:
        return CompletionOutput(request.req_id, request.prompt_ids, request.output_ids, request.text,
                                request.finish_reason, request.num_preemptions)
