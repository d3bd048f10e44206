# SPDX-License-Identifier: Apache-2.0
"""Engine-agnostic state: the block pool, the prefix cache over it, and the per-request token table."""

from __future__ import annotations

from trtllm_vtoken.core.block_pool import BlockPool
from trtllm_vtoken.core.prefix_cache import PrefixCache
from trtllm_vtoken.core.token_table import NO_SLOT, TokenTable

__all__ = ["NO_SLOT", "BlockPool", "PrefixCache", "TokenTable"]
