# SPDX-License-Identifier: Apache-2.0
"""Batch-invariant products: a row's result does not depend on what else the forward computes.

A matrix product's library picks its kernel, and with it the order in which each output element
sums its terms, from the shape. On this project's CPU build (MKL, AVX-512) a linear layer computes
one row one way (a GEMV), two or three rows another, and a row in a panel of four a third way; the
rows past the last full panel (the product's row count modulo 4) take yet another kernel, and so
does a query against fewer than 16 keys, by its position modulo 4. So a request's decode row
computed alone and in a batch of five differs in its last bits, and a greedy choice on a near-tie
can flip.

With ``row_multiple`` = P > 0 every product of the forward runs on a multiple of P rows:

    linear      x [..., in] -> rows [M, in], zero rows appended up to a multiple of P, their
                outputs dropped                                             (``project``)
    attention   each batch row alone over its own keys, padded (masked) to a multiple of
                ``KEY_MULTIPLE``, its queries padded so that a KV head's group of them is a
                multiple of P                                        (``runtime/attention.py``)

Then a row is always computed by the full-panel kernel at a position that does not depend on the
batch, and its logits are bitwise the same alone, in any batch, after a cached prefix or without
one; so is a decode step's attention mass. A prompt's mass at its prefill is summed per block of
its positions (heads, then the block's queries, as chains of elementwise adds: ``paged_attention``'s
``mass_blocks``), over layers, then folded block after block (``fold_blocks``) onto the mass a
cached prefix keeps, which is itself that fold's state at the prefix's end
(``runtime/prefix_caching.py``): the same bits whatever prefix was cached, or with caching off.
``find_row_multiple`` measures P for the model's shapes on the machine at hand (it depends on the
BLAS, its build and the thread count). With several intra-op threads a BLAS may split a product's
sums between threads by the row count, so that no P serves (a 2-core Xeon with AMX: none at two
threads, 16 at one); ``invariant_products`` then runs the forward on one thread, where each
product's order depends on its panel alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache, partial

import torch
from torch import nn

CANDIDATES = (4, 8, 16, 32)
"""The row multiples ``find_row_multiple`` tries, smallest first."""

KEY_MULTIPLE = 16
"""Keys a batch row's attention runs over are padded to a multiple of this."""

PROBE_MULTIPLES = (1, 2, 3, 4, 8, 16)
"""A probe compares batches of these multiples of P rows (an LM head's up to 8 P)."""


def padded(count: int, multiple: int) -> int:
    """``count`` rounded up to a multiple of ``multiple`` (0: ``count``)."""
    return -(-count // multiple) * multiple if multiple else count


def fold_blocks(start: torch.Tensor, blocks: torch.Tensor) -> list[torch.Tensor]:
    """The running sums ``start + blocks[0]``, ``(start + blocks[0]) + blocks[1]``, ...: ``start``
    [L] and ``blocks`` [n, L] -> n states [L]. A prompt's mass after its block j is the same bits
    whether the blocks before it were summed in this forward or kept with a cached prefix."""
    states, total = [], start
    for block in blocks:
        total = total + block
        states.append(total)
    return states


def project(linear: nn.Module, x: torch.Tensor, row_multiple: int) -> torch.Tensor:
    """``linear(x)`` computed on a multiple of ``row_multiple`` rows (0: ``linear(x)``). x: [..., in]."""
    if not row_multiple:
        return linear(x)
    rows = x.reshape(-1, x.shape[-1])
    count, target = rows.shape[0], padded(rows.shape[0], row_multiple)
    if target > count:
        rows = torch.cat([rows, rows.new_zeros(target - count, rows.shape[1])])
    return linear(rows)[:count].view(*x.shape[:-1], -1)


def find_row_multiple(model: nn.Module) -> int:
    """The smallest P of ``CANDIDATES`` for which every product of the model's shapes gives a row
    the same bits in batches of any probed multiple of P rows, at any probed position. Measured
    once per process for each set of shapes and thread count. RuntimeError if no P does."""
    weights = sorted({(tuple(m.weight.shape), m.weight.dtype) for m in model.modules()
                      if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
                      and not isinstance(m, nn.Embedding)}, key=str)
    cfg = model.config
    return _row_multiple(tuple(weights), cfg.num_key_value_heads, cfg.head_dim, torch.get_num_threads())


def invariant_products(model: nn.Module) -> tuple[int, int]:
    """(P, threads): the row multiple and the intra-op threads the batch-invariant forward runs
    on. The process's thread count where some P serves it; else one thread, with a warning (the
    forward then runs on one thread: ``intra_op_threads``). RuntimeError if no P serves one thread."""
    threads = torch.get_num_threads()
    try:
        return find_row_multiple(model), threads
    except RuntimeError:
        if threads == 1:
            raise
    with intra_op_threads(1):
        multiple = find_row_multiple(model)
    warnings.warn(f"batch_invariant: no row multiple of up to {CANDIDATES[-1]} gives a row the same bits at "
                  f"{threads} intra-op threads on this machine; the forward runs on one thread (P = {multiple})",
                  RuntimeWarning, stacklevel=2)
    return multiple, 1


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside, the process's count restored after
    (nothing done where they are equal already)."""
    before = torch.get_num_threads()
    if before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@lru_cache(maxsize=None)
def _row_multiple(weights: tuple, kv_heads: int, head_dim: int, threads: int) -> int:
    generator = torch.Generator().manual_seed(0)
    products = [(partial(_linear, torch.randn(shape, generator=generator).to(dtype)), shape[1], dtype)
                for shape, dtype in weights]
    for length in (KEY_MULTIPLE, 3 * KEY_MULTIPLE, 8 * KEY_MULTIPLE, 21 * KEY_MULTIPLE):  # the attention's
        keys = torch.randn(1, kv_heads, length, head_dim, generator=generator)
        products.append((partial(_per_head, keys.transpose(-1, -2)), head_dim, torch.float32))  # q k^T, as called
        products.append((partial(_per_head, torch.randn(1, kv_heads, length, head_dim, generator=generator)), length,
                         torch.float32))  # probabilities x values
    for multiple in CANDIDATES:
        if all(_same_bits(product, torch.randn(inner, generator=generator).to(dtype), multiple, generator)
               for product, inner, dtype in products):
            return multiple
    raise RuntimeError(f"batch_invariant: this machine's matrix products give a row different bits in batches of "
                       f"every multiple of up to {CANDIDATES[-1]} rows ({threads} threads)")


def _linear(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


def _per_head(other: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x as every KV head's rows, [1, Hkv, M, in] x [1, Hkv, in, out]: the first head's product."""
    return torch.matmul(x[None, None].repeat(1, other.shape[1], 1, 1), other)[0, 0]


def _same_bits(product: Callable, row: torch.Tensor, multiple: int, generator: torch.Generator) -> bool:
    """Whether ``row``'s product has the same bits among random rows in batches of the probed
    multiples of ``multiple`` rows, at its first four positions, the middle and the last."""
    large = product.args[0].numel() > (1 << 24)  # an LM head: the counts of a decode batch's rows
    first = None
    for count in (multiple * k for k in PROBE_MULTIPLES if not large or k <= 8):
        for position in sorted({0, 1, 2, 3, count // 2, count - 1}):
            x = torch.randn(count, row.shape[0], generator=generator).to(row.dtype)
            x[position] = row
            result = product(x)[position]
            if first is None:
                first = result
            elif not torch.equal(first, result):
                return False
    return True
