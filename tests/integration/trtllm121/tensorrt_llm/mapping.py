# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/mapping.py`` ``Mapping``: ``world_size = tp_size * pp_size * cp_size``
(the real constructor raises on a mismatch), ``enable_attention_dp`` (False by default), ranks laid
out tp-fastest (cp_size 1 modelled), and
``pp_layers(num_layers)``, the global ids of this pipeline rank's layers (contiguous, split as
evenly as possible), which ``KVCacheManager.__init__`` turns into ``pp_layers`` /
``layer_offsets`` (``get_pp_layers``; resource_manager.py, 1.2-era copy, index id 3501434665)."""

import numpy as np


class Mapping:
    def __init__(self, world_size: int = 1, rank: int = 0, tp_size: int = 1, pp_size: int = 1, cp_size: int = 1,
                 enable_attention_dp: bool = False, **kwargs) -> None:
        if world_size != tp_size * pp_size * cp_size:
            raise ValueError(f"world_size {world_size} != tp_size {tp_size} * pp_size {pp_size} * cp_size {cp_size}")
        self.world_size, self.rank, self.tp_size, self.pp_size = world_size, rank, tp_size, pp_size
        self.cp_size = cp_size
        self.enable_attention_dp = enable_attention_dp
        self.cp_config = {}

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def has_pp(self) -> bool:
        return self.pp_size > 1

    def pp_layers(self, num_layers: int) -> list[int]:
        return [int(i) for i in np.array_split(np.arange(num_layers), self.pp_size)[self.pp_rank]]
