# SPDX-License-Identifier: Apache-2.0
"""Builds the block-free view a policy sees from the token table."""

from __future__ import annotations

import numpy as np

from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.policies.base import PolicyView


def policy_view(table: TokenTable, req_id: int) -> PolicyView:
    live = table.live_ids(req_id)
    protected_ids = table.protected_ids(req_id)
    protected = np.isin(live, protected_ids) if len(protected_ids) else np.zeros(len(live), dtype=bool)
    return PolicyView(req_id, table.num_tokens(req_id), live, protected)
