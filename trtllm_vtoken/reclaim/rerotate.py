# SPDX-License-Identifier: Apache-2.0
"""Position-shift mode's pass: after compaction shortens a request's physical KV by d tokens,
every surviving cached key of that request is turned by ``-d * inv_freq`` (RoPE at position
p - d), so that keys always sit at (logical position - tokens removed so far) and a kernel that
rotates the new token by its physical position (``kv_len``) sees the query-key distances of the
logical sequence. Scores are unchanged exactly for position-linear RoPE (``rope.py``).

Only K moves; V carries no position. In the pool (TensorRT-LLM's primary-pool layout, HND):

    pool: [num_blocks, num_layers, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]
                                   ^ field 0
    slot s -> pool[s // tpb, :, 0, :, s % tpb, :]   every layer and head, rotated in place

The rotation is computed in float64 from the stored value and rounded once to the pool's dtype
(fp32/fp16/bf16). ``rerotate_slots`` is the specification; on CUDA the kernel in
``cpp/cuda/rerotate_k.cu`` runs instead when it is built (``cuda_kernel.py``).

Cost: reading and writing every live key of the request once per compaction, so a policy that
evicts a block's worth of tokens at a time amortises it; ``stats`` counts it.

In a 16-bit pool each pass rounds, and the roundings add up: a key turned back by 1 position 512
times in bfloat16 is 15% off (90 single roundings; tests/integration/test_engine_drift.py). Two
things bound it: fewer passes (chunked eviction: a pass per ``unit`` tokens lost) and, with
``recover``, no chain of roundings: a pass first turns each key forward by every position it has
been turned back since it was written and rounds it to the pool dtype -- which gives back the
value written, element by element, wherever the earlier roundings stayed within half a unit --
then turns that by the whole shift in one rotation, rounded once. Recovering needs, per request,
the shift at which each key was written (its keys written between two passes share one), kept
here, and doubles the pass's traffic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from trtllm_vtoken.reclaim.rope import RopeSpec, apply_rotation, rotation_at
from trtllm_vtoken.reclaim.upload import to_device


class LiveSlots(Protocol):
    def live_slots(self, req_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(live logical ids, their flat slots) of a request."""


@dataclass
class RerotationStats:
    passes: int = 0
    """Requests whose keys were re-rotated (one per compaction that shortened them)."""
    tokens: int = 0
    bytes: int = 0
    """Bytes read plus written: the K vector of each token, every layer and head."""


def rerotate_slots(pool: torch.Tensor, slots: torch.Tensor, shifts: torch.Tensor, rope: RopeSpec) -> None:
    """Turns the keys at ``slots`` back by ``shifts`` positions, in place (the reference).

    Args:
        pool: [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim].
        slots: [S] int64 flat slots on ``pool.device``, distinct.
        shifts: [S] int64, the positions each key moves back by.
    """
    tpb = pool.shape[4]
    blocks, offsets = slots // tpb, slots % tpb
    keys = pool[blocks, :, 0, :, offsets]  # [S, layers, heads, head_dim]
    cos, sin = rotation_at(-shifts, rope, torch.float64)  # [S, rotary_dim / 2]
    pool[blocks, :, 0, :, offsets] = apply_rotation(keys, cos[:, None, None, :], sin[:, None, None, :], rope)


class KeyRerotation:
    """Re-rotates the live keys of requests whose physical length shrank, in every pool.

    Args:
        pools: 6-D KV pools sharing blocks, tokens_per_block and device (one per group of layers).
        kernel: on CUDA, "auto" uses the CUDA kernel when it is built, "cuda" requires it,
            "torch" always uses ``rerotate_slots``. Ignored on CPU.
        recover: turn each key from the value it was written with, not from the last pass's
            (see the module docstring): for 16-bit pools.
    Raises:
        ValueError for pools that do not match ``rope`` (head_dim) or each other.
    """

    def __init__(self, pools: Sequence[torch.Tensor], rope: RopeSpec, kernel: str = "auto",
                 recover: bool = False) -> None:
        if not pools or any(p.dim() != 6 or p.shape[5] != rope.head_dim for p in pools):
            raise ValueError(f"pools must be 6-D with head_dim {rope.head_dim}, got {[tuple(p.shape) for p in pools]}")
        if len({(p.shape[0], p.shape[4], p.device) for p in pools}) != 1:
            raise ValueError("pools must share num_blocks, tokens_per_block and device")
        if kernel not in ("auto", "cuda", "torch"):
            raise ValueError(f"kernel must be 'auto', 'cuda' or 'torch', got {kernel!r}")
        self.pools = list(pools)
        self.rope = rope
        self.device = pools[0].device
        self.uses_kernel = False
        if self.device.type == "cuda" and kernel != "torch":
            from trtllm_vtoken.reclaim import cuda_kernel

            if kernel == "cuda" and cuda_kernel.load() is None:
                raise RuntimeError("kernel='cuda' but the CUDA kernels are not built")
            self.uses_kernel = cuda_kernel.load() is not None
        self.stats = RerotationStats()
        self.recover = recover
        self._shift: dict[int, int] = {}
        """request -> positions its keys have been turned back in all (recover)."""
        self._written_at: dict[int, np.ndarray] = {}
        """request -> per logical id, the request's shift when that key was written (recover)."""

    def bytes_per_token(self) -> int:
        """Bytes read plus written to turn one token's keys (every layer and head, every pool)."""
        return 2 * sum(p[0, :, 0, :, 0].numel() * p.element_size() for p in self.pools)

    def rotate_slots(self, slots: np.ndarray, shifts: np.ndarray, stream=None, count: bool = True) -> None:
        """Turns the keys at ``slots`` back by ``shifts`` positions (on CUDA: on ``stream``, by
        default the current one, which must already be ordered after any copy of those keys).
        ``count``: add the keys to ``stats.tokens`` (their bytes are counted either way)."""
        if len(slots) == 0:
            return
        if stream is not None:
            with torch.cuda.stream(stream):
                return self.rotate_slots(slots, shifts, count=count)
        slots_t = to_device(slots, torch.int64, self.device)
        shifts_t = to_device(shifts, torch.int64, self.device)
        for pool in self.pools:
            if self.uses_kernel:
                from trtllm_vtoken.reclaim.cuda_kernel import rerotate_keys_cuda

                rerotate_keys_cuda(pool, slots_t, shifts_t, self.rope)
            else:
                rerotate_slots(pool, slots_t, shifts_t, self.rope)
        self.stats.tokens += len(slots) if count else 0
        self.stats.bytes += len(slots) * self.bytes_per_token()

    def shift_requests(self, tables: LiveSlots, removed: Mapping[int, int], stream=None) -> int:
        """Turns every live key of each request back by the tokens its physical length lost
        (``removed[req] = d``, e.g. the batched step's ``lost``; requests with d = 0 are skipped).
        One pass for all of them (two rotations with ``recover``). ``tables``: a ``TokenTable``, or
        the batched step's core. Returns the tokens rotated. ValueError for a negative d (lengths
        only shrink here)."""
        slots, shifts, since_written = [], [], []
        for req_id, d in removed.items():
            if d < 0:
                raise ValueError(f"request {req_id}: physical length grew by {-d} during compaction")
            if d == 0:
                continue
            ids, live = tables.live_slots(req_id)
            slots.append(live)
            if self.recover:
                before, written = self._shift.get(req_id, 0), self._written_at.get(req_id, np.zeros(0, np.int64))
                if len(ids) and ids[-1] >= len(written):  # keys written since the last pass, all at `before`
                    written = np.concatenate([written, np.full(int(ids[-1]) + 1 - len(written), before)])
                self._written_at[req_id], self._shift[req_id] = written, before + d
                since_written.append(before - written[ids])
                shifts.append(before + d - written[ids])
            else:
                shifts.append(np.full(len(live), d, dtype=np.int64))
            self.stats.passes += 1
        if not slots:
            return 0
        all_slots, all_shifts = np.concatenate(slots), np.concatenate(shifts)
        if self.recover:  # back to the rotation each key was written at, on the pool dtype's grid
            back = np.concatenate(since_written)
            turned = back != 0
            self.rotate_slots(all_slots[turned], -back[turned], stream, count=False)
        self.rotate_slots(all_slots, all_shifts, stream)
        return len(all_slots)

    def forget(self, req_id: int) -> None:
        """The request left: drop what ``recover`` kept for it."""
        self._shift.pop(req_id, None)
        self._written_at.pop(req_id, None)
