# SPDX-License-Identifier: Apache-2.0
"""What an engine counts over its life (``Engine.stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
