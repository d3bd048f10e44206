# SPDX-License-Identifier: Apache-2.0
"""Stage 1 of reclamation: which requests and blocks may be planned at all (I4).

A block is eligible if it holds dead slots and is referenced by this request alone (a block
shared through prefix caching is read by others and is never written, moved or freed). A request
is eligible if it has such a block and no relocation of it is in flight.
"""

from __future__ import annotations

from collections.abc import Collection

from trtllm_vtoken.core.token_table import TokenTable


def eligible_blocks(table: TokenTable, req_id: int) -> list[int]:
    """Unshared blocks of the request with at least one dead slot below kv_len, in list order."""
    seq, tpb = table.seq(req_id), table.tokens_per_block
    indices = sorted({p // tpb for p in table.hole_positions(req_id)})
    return [seq.block_ids[i] for i in indices if not table.is_shared(seq.block_ids[i])]


def eligible_requests(table: TokenTable, in_flight: Collection[int]) -> list[int]:
    """Requests with an eligible block and no plan in flight, in table order."""
    return [r for r in table.request_ids() if r not in in_flight and eligible_blocks(table, r)]
