# SPDX-License-Identifier: Apache-2.0
"""The integer arguments of the token table, as both implementations take them.

The C++ core stores ids and lengths as int64, so the Python specification takes exactly what fits
there and refuses the rest with the same errors, before it looks at anything else (the C++
bindings convert through the same Python calls, so the messages are CPython's own):

    value                           both implementations
    int, numpy integer              the integer
    bool, numpy bool, torch bool    TypeError  "a bool is not a token id (...)": a list or array of
                                    bools is a mask, and taking it for ids would evict tokens 1
                                    and 0 for [True, False]; pass np.flatnonzero(mask)
    float, str, numpy float, ...    TypeError  "'float' object cannot be interpreted as an integer"
    an integer outside int64        ValueError "integer 2**63 is outside int64 [-2**63, 2**63 - 1]"
    a list of ids that is an int    TypeError  "'int' object is not iterable"

A request id must further lie in [0, 2**63 - 1]: the C++ table's hash map marks its empty
entries with -2**63, so that value can never name a request.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import index

import numpy as np

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
BOOL_MESSAGE = "a bool is not a token id (a mask? pass np.flatnonzero(mask), the ids it keeps or drops)"


def is_bool(value: object) -> bool:
    """A Python, numpy or torch boolean (scalar): what a mask holds, never an id."""
    if isinstance(value, bool):
        return True
    return str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def as_int(value: object) -> int:
    """``value`` as an int64-sized Python int. Raises TypeError or ValueError (module doc)."""
    if type(value) is not int:
        if is_bool(value):
            raise TypeError(BOOL_MESSAGE)
        value = index(value)  # type: ignore[arg-type]
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"integer {value} is outside int64 [{INT64_MIN}, {INT64_MAX}]")
    return value


def as_ints(values: Iterable[object]) -> list[int]:
    """Each value through ``as_int``, in order; the first bad one raises. A list of plain ints
    in range is returned as is (the decode step passes one or two)."""
    if type(values) is list:
        for value in values:
            if type(value) is not int or not INT64_MIN <= value <= INT64_MAX:
                return [as_int(v) for v in values]
        return values
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind == "i":
        return values.tolist()
    return [as_int(v) for v in values]


def as_request_id(value: object) -> int:
    """A new request's id: ``as_int``, then in [0, 2**63 - 1] (ValueError otherwise)."""
    req_id = as_int(value)
    if req_id < 0:
        raise ValueError(f"request id {req_id} is negative: request ids lie in [0, {INT64_MAX}]")
    return req_id
