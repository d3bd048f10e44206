# SPDX-License-Identifier: Apache-2.0
"""The test doubles of TensorRT-LLM 1.2.1 in one place.

The PyTorch-backend classes vToken hooks into live in ``trtllm121/tensorrt_llm/`` under their real
module paths and class names (each module's docstring cites the real file and function per
behaviour it imitates); they are re-exported here for in-process tests. Below them: the LLM-API
streaming surface ``TRTLLMLoop`` reads (``LLM.generate_async`` results), ``*Double121``, over the
double of ``executor/result.py``'s ``CompletionOutput``."""

from __future__ import annotations


from tests.integration.trtllm121 import ROOT as TRTLLM121_ROOT  # noqa: F401
from tests.integration.trtllm121.tensorrt_llm.bindings import CacheType, DataType  # noqa: F401
from tests.integration.trtllm121.tensorrt_llm.llmapi.llm_args import (  # noqa: F401
    CapacitySchedulerPolicy,
    KvCacheConfig,
    SchedulerConfig,
    TorchLlmArgs,
)
from tests.integration.trtllm121.tensorrt_llm.executor.result import CompletionOutput
from tests.integration.trtllm121.tensorrt_llm.mapping import Mapping  # noqa: F401
from tests.integration.trtllm121.tensorrt_llm.sampling_params import SamplingParams
from tests.integration.trtllm121.tensorrt_llm._torch.attention_backend.interface import (  # noqa: F401
    KVCacheParams,
    apply_rope,
)
from tests.integration.trtllm121.tensorrt_llm._torch.attention_backend.trtllm import (  # noqa: F401
    TrtllmAttention,
    TrtllmAttentionMetadata,
)
from tests.integration.trtllm121.tensorrt_llm._torch.pyexecutor.llm_request import (  # noqa: F401
    LlmRequest,
    SamplingConfig,
)
from tests.integration.trtllm121.tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager  # noqa: F401
from tests.integration.trtllm121.tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests  # noqa: F401


def make_request(req_id: int, prompt_len: int, max_new_tokens: int) -> LlmRequest:
    """An ``LlmRequest`` with a prompt of ``prompt_len`` tokens and beam width 1."""
    return LlmRequest(request_id=req_id, max_new_tokens=max_new_tokens, input_tokens=list(range(1, prompt_len + 1)),
                      sampling_config=SamplingConfig(beam_width=1))


class GenerationResultDouble121:
    """``generate_async(..., streaming=True)``'s result: async-iterable chunks, ``abort()``."""

    def __init__(self, pieces: list[tuple[int, str]], delay_s: float = 0.0) -> None:
        self.pieces, self.delay_s = pieces, delay_s
        self.output = CompletionOutput(0)
        self.outputs = [self.output]
        self.finished = False
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        import asyncio

        for i, (token, text) in enumerate(self.pieces):
            if self.aborted:
                return
            await asyncio.sleep(self.delay_s)
            out = self.output
            out._last_text_len, out._last_token_ids_len = len(out.text), len(out.token_ids)
            out.text += text
            out.token_ids.append(token)
            self.finished = i == len(self.pieces) - 1
            if self.finished:
                out.finish_reason = "length"
            yield self


class LLMDouble121:
    """``tensorrt_llm.LLM``: ``generate_async(inputs, sampling_params, streaming)`` and ``shutdown``.
    Echoes the prompt's ids back as ``max_tokens`` pieces ("<id>" each)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.results: list[GenerationResultDouble121] = []
        self.shut_down = False

    def generate_async(self, inputs, sampling_params=None, streaming=False):
        if not inputs:
            raise ValueError("empty prompt")
        ids = (list(inputs) * sampling_params.max_tokens)[: sampling_params.max_tokens]
        result = GenerationResultDouble121([(t, f"<{t}>") for t in ids], self.delay_s)
        self.results.append(result)
        return result

    def shutdown(self) -> None:
        self.shut_down = True


class TensorrtLlmApiDouble121:
    """The ``tensorrt_llm`` module surface ``TRTLLMLoop`` reads."""

    SamplingParams = SamplingParams
