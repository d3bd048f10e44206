# SPDX-License-Identifier: Apache-2.0
"""What the token table takes as ids and lengths, in both implementations: integers that fit
int64 (request ids non-negative, block ids inside the int32 slot encoding); anything else is
refused with the same exception and message, and nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.core import TokenTable
from trtllm_vtoken.core.native import load, native_table

IMPLEMENTATIONS = ["python", pytest.param("cpp", marks=pytest.mark.skipif(load() is None, reason="C++ core not built"))]


def make(impl: str, tpb: int = 4):
    """A table holding request 0: tokens 0-5 in blocks 1 and 2."""
    table = TokenTable(tpb) if impl == "python" else native_table(tpb)
    table.add_request(0)
    table.append_tokens(0, [1, 2], 6)
    return table


def state(table, req: int = 0) -> tuple:
    if isinstance(table, TokenTable):
        s, tpb = table.seq(req), table.tokens_per_block
        nb = len(s.block_ids)
        return (list(s.block_ids), s.kv_len, s.num_tokens, s.num_live, s.version,
                s.slot_of[: s.num_tokens].tolist(), s.live[: s.num_tokens].tolist(),
                s.token_at[: nb * tpb].tolist(), s.live_per_block[:nb].tolist(), list(s.pending_dead))
    return tuple(table.state(req))


def refused(table, call, error, message):
    """``call(table)`` raises ``error`` with exactly ``message``, and changes no request."""
    before = {r: state(table, r) for r in table.request_ids()}
    with pytest.raises(error) as caught:
        call(table)
    text = caught.value.args[0] if error is KeyError else str(caught.value)
    assert text == message
    assert {r: state(table, r) for r in table.request_ids()} == before


NOT_AN_INT = "'{}' object cannot be interpreted as an integer"
A_BOOL = "a bool is not a token id (a mask? pass np.flatnonzero(mask), the ids it keeps or drops)"
BIG = 2**63


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("call", "message"), [
    (lambda t: t.evict_tokens(0, [1.7]), NOT_AN_INT.format("float")),
    (lambda t: t.evict_tokens(0, ["2"]), NOT_AN_INT.format("str")),
    (lambda t: t.evict_tokens(0, [np.float64(3.0)]), NOT_AN_INT.format("numpy.float64")),
    (lambda t: t.evict_tokens(0, 3), "'int' object is not iterable"),
    (lambda t: t.evict_tokens(0.0, [1]), NOT_AN_INT.format("float")),
    (lambda t: t.evict_tokens("x", [1.5]), NOT_AN_INT.format("str")),  # arguments in order
    (lambda t: t.evict_tokens(7, [1.5]), NOT_AN_INT.format("float")),  # before the request lookup
    (lambda t: t.append_tokens(0, [5.5], 2), NOT_AN_INT.format("float")),
    (lambda t: t.append_tokens(0, [5], 1.5), NOT_AN_INT.format("float")),
    (lambda t: t.sync_new_tokens(0, [1, 2, 3.0], 9), NOT_AN_INT.format("float")),
    (lambda t: t.apply_moves(0, [5], [4.0]), NOT_AN_INT.format("float")),
    (lambda t: t.truncate(0, 5.0), NOT_AN_INT.format("float")),
    (lambda t: t.release_blocks(0, [None]), NOT_AN_INT.format("NoneType")),
    (lambda t: t.kv_len(0.0), NOT_AN_INT.format("float")),
    (lambda t: 0.0 in t, NOT_AN_INT.format("float")),
    (lambda t: t.add_request(1.0), NOT_AN_INT.format("float")),
])
def test_values_that_are_not_integers_raise_type_error(impl, call, message):
    refused(make(impl), call, TypeError, message)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda t: t.evict_tokens(0, [BIG]), ValueError,
     f"integer {BIG} is outside int64 [-{BIG}, {BIG - 1}]"),
    (lambda t: t.append_tokens(0, [], -BIG - 1), ValueError,
     f"integer {-BIG - 1} is outside int64 [-{BIG}, {BIG - 1}]"),
    (lambda t: t.kv_len(BIG), ValueError, f"integer {BIG} is outside int64 [-{BIG}, {BIG - 1}]"),
    (lambda t: t.add_request(-1), ValueError, f"request id -1 is negative: request ids lie in [0, {BIG - 1}]"),
    (lambda t: t.add_request(-BIG), ValueError,
     f"request id {-BIG} is negative: request ids lie in [0, {BIG - 1}]"),
    (lambda t: t.kv_len(-BIG), KeyError, f"unknown request {-BIG}"),
    (lambda t: t.evict_tokens(-BIG, [0]), KeyError, f"unknown request {-BIG}"),
    (lambda t: t.remove_request(-BIG), KeyError, f"unknown request {-BIG}"),
    (lambda t: t.release_blocks(0, [-BIG]), ValueError, f"request 0: block {-BIG} is not one of its blocks"),
])
def test_integers_outside_the_supported_range_are_refused(impl, call, error, message):
    refused(make(impl), call, error, message)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_the_hash_map_marker_names_no_request(impl):
    """-2**63 marks the C++ hash map's empty entries: it must never find a request."""
    table = make(impl)
    assert -BIG not in table and BIG not in table and 0 in table
    table.remove_request(0)
    assert -BIG not in table
    with pytest.raises(KeyError, match="unknown request"):
        table.kv_len(-BIG)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_integer_like_values_are_taken(impl):
    table = make(impl)
    table.evict_tokens(np.int64(0), np.array([2], dtype=np.int32))
    table.evict_tokens(0, (np.uint8(3), 1))  # any iterable of integers (a bool is refused: a mask)
    table.append_tokens(np.int64(0), [np.int64(3)], np.int16(2))
    assert table.kv_len(0) == 8 and table.num_live(0) == 5


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("tpb", [4, 5])
def test_block_ids_must_fit_the_int32_slot_encoding(impl, tpb):
    """A slot is block * tokens_per_block + offset in an int32: block 2**31 // tpb would wrap."""
    limit = 2**31 // tpb
    table = make(impl, tpb)
    refused(table, lambda t: t.append_tokens(0, [limit], 1), ValueError,
            f"request 0: new blocks [{limit}] repeat a block or lie outside [0, {limit}) "
            f"(slots are int32: block * {tpb} + offset)")
    table.append_tokens(0, [], 2 * tpb - 6)  # fill block 2
    table.append_tokens(0, [limit - 1], tpb)
    last_slot = state(table)[5][-1]
    assert last_slot == (limit - 1) * tpb + tpb - 1 <= 2**31 - 1


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("call", [
    lambda t: t.evict_tokens(0, [True, False]),  # a mask taken for ids would evict tokens 1 and 0
    lambda t: t.evict_tokens(0, np.array([False, True, True])),
    lambda t: t.evict_tokens(0, [np.True_]),
    lambda t: t.evict_tokens(0, __import__("torch").tensor([True, False])),
    lambda t: t.evict_tokens(True, [1]),
    lambda t: t.append_tokens(0, [5], True),
], ids=["list", "numpy-array", "numpy-scalar", "torch-tensor", "request-id", "length"])
def test_bools_are_refused_as_ids(impl, call):
    refused(make(impl), call, TypeError, A_BOOL)
