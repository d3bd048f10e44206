# SPDX-License-Identifier: Apache-2.0
"""Relocation planning: dense and lazy compaction, one plan form (design §3).

Dense, for kernels that attend every position in [0, kv_len) (TensorRT-LLM, FlashInfer, XQA).
tokens_per_block = 4, L live, . dead:

    before: [L L . L][. L L L][L L . .]   kv_len 12, 8 live -> new length R = 8
    holes below R: positions 2, 4     live at or above R: positions 9, 8
    moves:  9 -> 2, 8 -> 4            (highest live token into the lowest hole: one copy per hole)
    after:  [L L L L][L L L L]         kv_len 8; block 3 released: exactly ceil(R / 4) blocks

Lazy, for attention that takes a validity mask: dead tokens stay masked and only blocks that can
be emptied are touched. Freeing k blocks needs k * tokens_per_block holes in the blocks kept, so
k = floor(holes / tokens_per_block); the k full blocks with the fewest live tokens are the
sources (fewest copies), their live tokens go into holes of the fullest remaining blocks.

    before: [L . . .][L L . L][. L . L][L L _ _]   kv_len 14: holes 3, 1, 2 (+ tail)
    k = floor(6 / 4) = 1 -> source block 0 (1 live token); destination: hole in block 1
    after:  [L L L L][. L . L][L L _ _]          one block released, 3 still hold holes

The lazy plan exactly (the pairing rule; ``tests/reclaim/test_step_batch.py`` checks it against
an oracle written from this list):
  1. holes: positions below kv_len holding a dead token or none, in unshared blocks;
  2. candidates: unshared blocks lying wholly below kv_len (the tail block is still written);
  3. k = min(floor(holes / tokens_per_block), candidates); no plan if k = 0;
  4. sources: the k candidates with the fewest live tokens, the later block first among equals;
  5. the sources' live tokens, in position order, go to the holes outside the sources ordered by
     their block's live count (highest first), then by position: the i-th token to the i-th hole;
  6. the sources are released, in list order. ``plan_for_mode`` plans only at or past the
     fragmentation threshold (blocks held minus ceil(live / tokens_per_block)), or under pressure.

Both return None when there is nothing worth doing, and never touch a shared block. A dense
request's length never ends inside a shared block (its next token would be written over KV
another request reads): it stays at that block's end, above the block's dead tokens, and the
request continues in a fresh block.
"""

from __future__ import annotations

from bisect import bisect_left

from trtllm_vtoken.core.sequence import NO_TOKEN
from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.reclaim.plan import RelocationPlan

def plan_dense(table: TokenTable, req_id: int) -> RelocationPlan | None:
    """Fills every hole below the new length with the highest live tokens; releases the tail.

    Returns None if the request has no hole, if the plan would touch a shared block, or if a
    shared block leaves it nothing to do.
    """
    seq, tpb = table.seq(req_id), table.tokens_per_block
    holes = table.hole_positions(req_id)  # ascending
    if not holes:
        return None
    new_len = seq.kv_len - len(holes)
    below = bisect_left(holes, new_len)
    dst_pos = holes[:below]
    dead_tail = set(holes[below:])
    src_pos = [p for p in range(seq.kv_len - 1, new_len - 1, -1) if p not in dead_tail]
    if len(src_pos) != len(dst_pos):  # a broken table: moving these would overwrite live KV
        raise RuntimeError(f"dense plan for request {req_id}: {len(src_pos)} live tokens above the new "
                           f"length {new_len} but {len(dst_pos)} holes below it")
    blocks, is_shared = seq.block_ids, table.is_shared
    blocks_to_free = tuple(blocks[-(-new_len // tpb) :])
    if (
        any(is_shared(b) for b in blocks_to_free)
        or any(is_shared(blocks[p // tpb]) for p in src_pos)
        or any(is_shared(blocks[p // tpb]) for p in dst_pos)
    ):
        return None
    if new_len % tpb and is_shared(blocks[new_len // tpb]):
        # Only dead tokens of that block lie at or above new_len (a live one would be a source in a
        # shared block): keep them, and the request's next token goes into a fresh block.
        new_len = min(seq.kv_len, new_len - new_len % tpb + tpb)
        if not src_pos and not blocks_to_free and new_len == seq.kv_len:
            return None
    return _make_plan(table, req_id, "dense", src_pos, dst_pos, blocks_to_free, new_len)


def plan_lazy(table: TokenTable, req_id: int) -> RelocationPlan | None:
    """Empties the lowest-utilization blocks into holes of the others.

    Only blocks lying wholly below kv_len are sources (the tail block is still being written).
    Returns None unless at least one block is freed: the request's block count must strictly drop.
    """
    seq, tpb = table.seq(req_id), table.tokens_per_block
    if len(seq.pending_dead) < tpb:
        return None  # holes are among these hints: too few to empty a block (no rescan needed)
    holes = table.hole_positions(req_id)
    if len(holes) < tpb:
        return None
    blocks = seq.block_ids
    usable = [h for h in holes if not table.is_shared(blocks[h // tpb])]
    full_blocks = seq.kv_len // tpb
    candidates = [i for i in range(full_blocks) if not table.is_shared(blocks[i])]
    num_to_free = min(len(usable) // tpb, len(candidates))
    if num_to_free == 0:
        return None
    live_per_block, token_at, live = seq.live_per_block_mv, seq.token_at_mv, seq.live_mv
    # Fewest live tokens first; among equals the later block (its tokens are younger, and the
    # prefix stays put), which keeps plans stable from step to step.
    candidates.sort(key=lambda i: (live_per_block[i], -i))
    sources = sorted(candidates[:num_to_free])
    source_set = set(sources)
    src_pos = [
        int(p)
        for i in sources
        for p in range(i * tpb, (i + 1) * tpb)
        if token_at[p] != NO_TOKEN and live[token_at[p]]
    ]
    # Destinations: holes of the kept blocks, fullest block first, so the blocks left with holes
    # are the emptiest ones and become the next plan's cheap sources.
    targets = [h for h in usable if h // tpb not in source_set]
    targets.sort(key=lambda h: (-live_per_block[h // tpb], h))
    dst_pos = targets[: len(src_pos)]
    if len(dst_pos) != len(src_pos):  # a broken table: the sources' live KV would be lost
        raise RuntimeError(f"lazy plan for request {req_id}: {len(dst_pos)} holes for the "
                           f"{len(src_pos)} live tokens of the chosen sources")
    blocks_to_free = tuple(blocks[i] for i in sources)
    return _make_plan(table, req_id, "lazy", src_pos, dst_pos, blocks_to_free, None)


def plan_for_mode(table: TokenTable, req_id: int, mode: str, fragmentation_threshold: int = 1,
                  pressure: bool = False) -> RelocationPlan | None:
    """The plan a compaction mode makes now: dense always plans; lazy only at or past the
    fragmentation threshold, or under memory ``pressure``."""
    if mode == "dense":
        return plan_dense(table, req_id)
    if not pressure and fragmentation(table, req_id) < fragmentation_threshold:
        return None
    return plan_lazy(table, req_id)


def commit_plan(table: TokenTable, plan: RelocationPlan) -> list[int]:
    """The table's half of a commit, once the plan's KV is copied: ``apply_moves``, then
    ``truncate`` (dense) or ``release_blocks`` (lazy). Returns the released block ids, which the
    caller frees in its pool.

    All or nothing: raises ValueError (KeyError for a removed request), changing nothing, if the
    plan no longer applies (``check_commit``).
    """
    check_commit(table, plan)
    table.apply_moves(plan.req_id, plan.token_ids, plan.dst_slots)
    if plan.new_kv_len is None:
        table.release_blocks(plan.req_id, plan.blocks_to_free)
        return list(plan.blocks_to_free)
    return table.truncate(plan.req_id, plan.new_kv_len)


def check_commit(table: TokenTable, plan: RelocationPlan) -> None:
    """Runs every check of ``commit_plan``'s calls before the first one changes anything.

    A dense plan commits only against the table version it was taken from (as the C++ core's
    ``commit``): its new length and released tail come from that snapshot, and a token written
    since lies beyond them. A lazy plan may commit after evictions and appends made while its
    copy ran (background compaction), as long as its moves and releases still apply.
    """
    req_id = plan.req_id
    version = table.version(req_id)
    if plan.mode == "dense" and plan.version != version:
        raise ValueError(
            f"plan for request {req_id} was taken from table version {plan.version}, table is at {version}"
        )
    if plan.mode == "lazy" and plan.blocks_after >= plan.blocks_before:
        raise ValueError(f"lazy plan for request {req_id} does not reduce its {plan.blocks_before} blocks")
    if plan.mode == "lazy":  # the KV copied must still be the moving tokens' KV
        for token_id, src in zip(plan.token_ids, plan.src_slots):
            if not 0 <= token_id < table.num_tokens(req_id) or table.seq(req_id).slot_of_mv[token_id] != src:
                raise ValueError(f"plan for request {req_id}: token {token_id} is no longer at its planned source {src}")
    moves = table.move_positions(req_id, list(plan.token_ids), list(plan.dst_slots))
    if plan.new_kv_len is None:
        table.check_release(req_id, list(plan.blocks_to_free), moves)
        return
    released = table.check_truncate(req_id, plan.new_kv_len, moves)
    if released != list(plan.blocks_to_free):
        raise ValueError(f"plan for request {req_id}: truncating releases {released}, planned {plan.blocks_to_free}")


def fragmentation(table: TokenTable, req_id: int) -> int:
    """Blocks held beyond the ideal ceil(live / tokens_per_block)."""
    seq, tpb = table.seq(req_id), table.tokens_per_block
    return len(seq.block_ids) - -(-seq.num_live // tpb)


def _make_plan(
    table: TokenTable,
    req_id: int,
    mode: str,
    src_pos: list[int],
    dst_pos: list[int],
    blocks_to_free: tuple[int, ...],
    new_kv_len: int | None,
) -> RelocationPlan:
    seq, tpb = table.seq(req_id), table.tokens_per_block
    blocks, token_at = seq.block_ids, seq.token_at_mv
    return RelocationPlan(
        req_id=req_id,
        mode=mode,
        version=seq.version,
        token_ids=tuple(token_at[p] for p in src_pos),
        src_slots=tuple(blocks[p // tpb] * tpb + p % tpb for p in src_pos),
        dst_slots=tuple(blocks[p // tpb] * tpb + p % tpb for p in dst_pos),
        blocks_to_free=blocks_to_free,
        blocks_before=len(blocks),
        new_kv_len=new_kv_len,
    )
