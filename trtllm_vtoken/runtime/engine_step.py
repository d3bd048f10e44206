# SPDX-License-Identifier: Apache-2.0
"""The one batched step an engine's KV-cache manager runs, built from the engine's config."""

from __future__ import annotations

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.prefix_caching import PrefixCaching
from trtllm_vtoken.step import DecodeStep, StepConfig


def make_step(config: EngineConfig, num_blocks: int, pool: BlockPool, executor,
              rerotation: KeyRerotation | None = None, prefix: PrefixCaching | None = None,
              policy: EvictionPolicy | None = None) -> DecodeStep:
    """The step an engine of ``config`` runs (vtoken: its compaction mode; naive-evict: dead
    blocks). Shift positions commit lazy plans in their own step: the keys turn right after.
    With ``prefix``, its shared blocks are protected and evicting requests' chains are cut."""
    compaction = config.mode if config.variant == "vtoken" else "dead-blocks"
    background = compaction == "lazy" and config.lazy_background and rerotation is None
    is_shared, shared = (prefix.cache.is_shared, lambda: prefix.cache.shared) if prefix else (pool.is_shared,
                                                                                              lambda: pool.shared)
    step = DecodeStep(StepConfig(compaction, config.fragmentation_threshold, config.check_invariants, config.step_impl,
                                 background, threads=config.step_threads),
                      num_blocks, config.tokens_per_block, policy or config.make_policy(), executor, is_shared,
                      shared, rerotation=rerotation)
    if prefix is not None:
        step.on_victims = prefix.cut_batch
    return step
