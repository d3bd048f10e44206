# SPDX-License-Identifier: Apache-2.0
"""vToken: token-level virtualization for reclaimable KV caches.

Importing the package is cheap: numpy only. torch is imported by the modules that move KV
(``reclaim.copy``, ``reclaim.invariants``) and by the runtime, never here.
"""

from __future__ import annotations

__version__ = "0.1.0"
