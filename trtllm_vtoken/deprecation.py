# SPDX-License-Identifier: Apache-2.0
"""Deprecated names stay for one release and warn with their replacement.

The suite turns ``VTokenDeprecationWarning`` into an error (pyproject's ``filterwarnings``): the
project's own code and tests never use what they deprecate, except where a test checks the
warning itself.
"""

from __future__ import annotations

import warnings


class VTokenDeprecationWarning(DeprecationWarning):
    """A name of trtllm_vtoken's that is going away; the message says what replaces it."""


def warn_deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that ``old`` is deprecated in favour of ``new``; ``stacklevel`` 3 points at the
    caller of the function that calls this."""
    warnings.warn(f"{old} is deprecated and goes away in the next release: use {new}",
                  VTokenDeprecationWarning, stacklevel=stacklevel)
