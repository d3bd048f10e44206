# SPDX-License-Identifier: Apache-2.0
"""The simulated-attention backend: the engine's scheduler, admission, token table, planner and
block pool, run exactly, with a synthetic attention-score generator in place of a model.

It answers block-accounting questions (how many requests fit a pool, how many blocks each
variant retains) at the shapes of models this machine cannot run, e.g. Llama-3.1-8B with 12k-token
outputs, in seconds to minutes on a CPU. Every result from it is labelled "simulated".

Synthetic attention (what H2O and Scissorhands observe): token ``i`` of request ``r`` has an
intrinsic weight ``w_i ~ LogNormal(0, sigma)`` (seeded by ``(seed, r, i)``), sink tokens get a
large weight, and attention at a step is ``w_i * (1 + recency / (1 + age_i))`` normalised over
the live tokens. This gives heavy hitters scattered through the sequence, which is what makes
token-level eviction leave blocks partly live.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtllm_vtoken.runtime.model import LlamaConfig


@dataclass(frozen=True)
class ModelShape:
    """What KV accounting needs of a model: layers, KV heads, head size, bytes per element."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def as_llama_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=2, hidden_size=self.num_kv_heads * self.head_dim, intermediate_size=1,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_kv_heads,
                           num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim)


MODEL_SHAPES = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 8, 128),
    "qwen2.5-14b": ModelShape("qwen2.5-14b", 48, 8, 128),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 3, 64, dtype_bytes=4),
}


class SyntheticAttention:
    """Deterministic per-token attention scores; see the module docstring."""

    def __init__(self, seed: int = 0, sigma: float = 1.0, n_sink: int = 4, sink_weight: float = 50.0,
                 recency: float = 8.0) -> None:
        self.seed, self.sigma, self.n_sink = seed, sigma, n_sink
        self.sink_weight, self.recency = sink_weight, recency
        self._weights: dict[int, np.ndarray] = {}

    def weights(self, req_id: int, num_tokens: int) -> np.ndarray:
        """Intrinsic weights of logical ids [0, num_tokens). Chunk ``k`` (ids 1024k..1024k+1023)
        comes from its own seeded stream, so values never depend on how the array grew."""
        have = self._weights.get(req_id, np.zeros(0))
        if len(have) < num_tokens:
            chunks = [have] + [np.random.default_rng([self.seed, req_id, k]).lognormal(0.0, self.sigma, 1024)
                               for k in range(len(have) // 1024, -(-num_tokens // 1024))]
            have = np.concatenate(chunks)
            have[: self.n_sink] = self.sink_weight
            self._weights[req_id] = have
        return have[:num_tokens]

    def scores(self, req_id: int, token_ids: np.ndarray, num_tokens: int, num_queries: int) -> np.ndarray:
        """Attention mass received by ``token_ids`` from ``num_queries`` queries (summed)."""
        w = self.weights(req_id, num_tokens)[token_ids]
        age = (num_tokens - 1 - token_ids).astype(np.float64)
        s = w * (1.0 + self.recency / (1.0 + age))
        return num_queries * s / s.sum()

    def batch_mass(self, req_ids: list[int], num_queries: list[int], dtype: type = np.float64):
        """The step's ``Mass`` function for a batch: attention per physical position of the
        batch's token layout (tokens [B, L], -1 where no live token), from ``num_queries`` queries
        of each request. A request's logical length is read off its layout: its newest token was
        written this step and is live, so it is the row's highest id + 1."""

        def mass(tokens: np.ndarray) -> np.ndarray:
            out = np.zeros(tokens.shape, dtype=dtype)
            num_tokens = tokens.max(axis=1) + 1
            for i, req_id in enumerate(req_ids):
                live = np.flatnonzero(tokens[i] >= 0)
                out[i, live] = self.scores(req_id, tokens[i, live].astype(np.int64), int(num_tokens[i]), num_queries[i])
            return out

        return mass

    def forget(self, req_id: int) -> None:
        self._weights.pop(req_id, None)


class SimulatedModel(torch.nn.Module):
    """Stands in for the model in ``Engine``: no weights, no KV; token 1 forever (never EOS); the
    attention mass per physical position comes from ``SyntheticAttention`` through the table."""

    simulated = True

    def __init__(self, shape: ModelShape, attention: SyntheticAttention | None = None,
                 mass_dtype: type = np.float64, device_forward_us: float = 0.0) -> None:
        """``mass_dtype``: what the batch's mass arrives as; float32 is what attention kernels
        (and the TensorRT-LLM adapter's recorded queries) return. ``device_forward_us``: the
        device time of one forward, as a GPU's: the forward is launched and returns at once, and
        the engine's thread waits for the device only when it samples (``Forwards.wait``)."""
        super().__init__()
        if device_forward_us < 0:
            raise ValueError(f"device_forward_us must be >= 0, got {device_forward_us}")
        self.device_forward_us = device_forward_us
        self.shape = shape
        self.config = shape.as_llama_config()
        self.attention = attention or SyntheticAttention()
        self.mass_dtype = mass_dtype

    def batch_mass(self, req_ids: list[int], num_queries: list[int]):
        """The step's ``Mass`` function for a batch (``SyntheticAttention.batch_mass``, in
        ``mass_dtype``). Stands in for the attention of a forward, so the step does not count its
        time (nor this per-request work, which a real forward does not do on the host) as its own."""
        return self.attention.batch_mass(req_ids, num_queries, self.mass_dtype)
