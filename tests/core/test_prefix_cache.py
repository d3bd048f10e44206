# SPDX-License-Identifier: Apache-2.0
"""The prefix cache: keys, sharing by reference count, LRU retention, and the eviction cut."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.core.block_key import ROOT_KEY, block_keys, chain_key
from trtllm_vtoken.core.prefix_cache import PrefixCache

B = 4


def start(cache: PrefixCache, req_id: int, tokens: list[int]) -> list[int]:
    """A request as an engine runs it: cached prefix, fresh blocks for the rest, then its keys."""
    blocks = cache.begin(req_id, tokens)
    fresh = cache.allocate(-(-len(tokens) // B) - len(blocks))
    assert fresh is not None
    blocks += fresh
    cache.extend(req_id, blocks, tokens)
    return blocks


def test_keys_chain_over_the_whole_prefix():
    a = block_keys(list(range(10)), B)
    assert len(a) == 2  # the partial third block has no key
    assert a[1] == chain_key(a[0], [4, 5, 6, 7]) and a[0] == chain_key(ROOT_KEY, [0, 1, 2, 3])
    # Same second block after a different first block: a different key (its KV differs).
    b = block_keys([9, 1, 2, 3, 4, 5, 6, 7], B)
    assert b[0] != a[0] and b[1] != a[1]
    assert block_keys(list(range(10)), B, num_blocks=1) == a[:1]


def test_keys_are_equal_across_processes():
    """Ranks and workers must agree on keys: no per-process salt (Python's str hash has one)."""
    code = "from trtllm_vtoken.core.block_key import block_keys; print(block_keys(list(range(8)), 4))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str(block_keys(list(range(8)), 4))


def test_second_request_reuses_the_cached_chain_and_shares_its_blocks():
    pool = BlockPool(8, B)
    cache = PrefixCache(pool)
    prompt = list(range(10))
    first = start(cache, 0, prompt)
    assert first == [0, 1, 2]
    # Blocks 0 and 1 are full: keyed, one reference of the request plus the cache's own.
    assert pool.ref_counts[:3] == [2, 2, 1] and cache.is_cached(0) and not cache.is_cached(2)
    assert not cache.is_shared(0) and cache.holders(0) == 1
    second = start(cache, 1, prompt[:8] + [50, 51, 52])
    assert second[:2] == [0, 1] and second[2] == 3
    assert cache.cached_tokens(1) == 8 and cache.is_shared(0) and cache.holders(1) == 2
    assert cache.stats.query_tokens == 21 and cache.stats.hit_tokens == 8
    cache.check_integrity()
    pool.check_integrity()


def test_the_last_prompt_token_is_always_computed():
    pool = BlockPool(8, B)
    cache = PrefixCache(pool)
    start(cache, 0, list(range(8)))
    # An identical 8-token prompt: only block 0 is reused, so token 7's logits get computed.
    assert cache.match(list(range(8))) == [0]
    assert cache.match(list(range(9))) == [0, 1]


def test_finished_blocks_stay_cached_and_are_reclaimed_tail_first():
    pool = BlockPool(4, B)
    cache = PrefixCache(pool)
    blocks = start(cache, 0, list(range(12)))
    cache.end(0, blocks)
    assert pool.num_free == 1 and cache.num_reclaimable == 3 and cache.num_available == 4
    assert list(cache.unheld) == [2, 1, 0]  # the tail first out: the prefix survives longest
    # A new request reuses the cached prefix even after its owner left.
    assert cache.match(list(range(9))) == [0, 1]
    assert cache.allocate(2) == [3, 2]  # one free block, then the least recent cached one
    assert not cache.is_cached(2) and cache.stats.reclaimed_blocks == 1
    assert cache.allocate(3) is None and cache.num_available == 2  # nothing changed
    cache.check_integrity()
    pool.check_integrity()


def test_reused_block_leaves_the_lru_while_held():
    pool = BlockPool(4, B)
    cache = PrefixCache(pool)
    cache.end(0, start(cache, 0, list(range(9))))
    assert list(cache.unheld) == [1, 0]
    cache.begin(1, list(range(5)))
    assert list(cache.unheld) == [1] and cache.holders(0) == 1
    # Block 0 is held again, so an allocation cannot take it.
    assert cache.allocate(4) is None
    assert cache.allocate(3) == [3, 2, 1]  # the free list first (3, then the released 2)


def test_cut_drops_keys_from_the_lowest_victim_block_on_and_stops_storing():
    pool = BlockPool(8, B)
    cache = PrefixCache(pool)
    tokens = list(range(14))
    blocks = start(cache, 0, tokens)
    assert [cache.is_cached(b) for b in blocks] == [True, True, True, False]
    assert cache.cut(0, blocks, 5) == 2  # token 5 is in block 1: blocks 1 and 2 lose their keys
    assert [cache.is_cached(b) for b in blocks] == [True, False, False, False]
    assert pool.ref_counts[:4] == [2, 1, 1, 1]
    # Decode fills block 3: it is never keyed, the request's KV may have moved into it.
    assert cache.extend(0, blocks, tokens + [20, 21]) == [] and not cache.is_cached(blocks[3])
    assert cache.cut(0, blocks, 9) == 0  # later cuts change nothing
    assert cache.cut(0, blocks, 1) == 1 and pool.ref_counts[0] == 1
    assert cache.stats.dropped_keys == 3
    cache.check_integrity()


def test_keys_are_due_when_a_write_fills_a_block_past_the_chain_before_its_cut():
    pool = BlockPool(8, B)
    cache = PrefixCache(pool)
    blocks = start(cache, 0, list(range(6)))  # block 0 keyed, block 1 half full
    assert not cache.due([0], [7])
    assert cache.due([0], [9])  # a step of 3 tokens (drafts) passes block 1's end without landing on it
    cache.extend(0, blocks + cache.allocate(1), list(range(9)))
    assert not cache.due([0], [9]) and cache.due([0], [12])
    cache.cut(0, blocks, 2)  # the chain ends at block 0: nothing is due any more
    assert not cache.due([0], [20])


def test_cut_refuses_shared_blocks_and_changes_nothing():
    pool = BlockPool(8, B)
    cache = PrefixCache(pool)
    first = start(cache, 0, list(range(9)))
    start(cache, 1, list(range(8)) + [99])
    refs = list(pool.ref_counts)
    with pytest.raises(ValueError, match=r"blocks \[0, 1\] are shared"):
        cache.cut(0, first, 0)
    assert pool.ref_counts == refs and cache.is_cached(0) and cache.is_cached(1)
    # Past the shared part a cut is fine.
    assert cache.cut(0, first, 8) == 0


def test_a_cut_before_a_shared_block_drops_its_key_and_its_holders_keep_it():
    """Request 1 took block 0 only and computed block 1 again (a copy of request 0's, unkeyed),
    then block 2 (keyed); request 2 took blocks 0 and 1 from request 0 and block 2 from request
    1. Request 1 evicting in its own block 1 ends its chain there: block 2 loses its key (nobody
    takes it any more) but stays with both holders, shared."""
    pool = BlockPool(12, B)
    cache = PrefixCache(pool)
    tokens = list(range(13))
    start(cache, 0, tokens[:9])  # blocks 0, 1 keyed
    mine = cache.begin(1, tokens, computed_tail=9) + cache.allocate(3)  # block 0 cached, the rest its own
    assert cache.extend(1, mine, tokens) == [2]  # index 1 repeats request 0's block; index 2 is new
    theirs = cache.begin(2, tokens[:12] + [99])
    assert theirs == [0, 1, mine[2]] and cache.is_shared(mine[2])
    assert cache.cut(1, mine, 4) == 1  # token 4 sits in request 1's own index-1 block
    assert not cache.is_cached(mine[2]) and cache.is_shared(mine[2]) and cache.holders(mine[2]) == 2
    assert cache.match(tokens[:12] + [5]) == [0, 1]
    cache.check_integrity()


def test_duplicate_content_stays_private_and_the_chain_goes_on():
    """Two requests with one prompt admitted together: the second computed its own copy."""
    pool = BlockPool(8, B)
    cache = PrefixCache(pool)
    prompt = list(range(13))
    a = cache.begin(0, prompt) + cache.allocate(4)
    b = cache.begin(1, prompt) + cache.allocate(4)  # nothing stored yet: no hit
    assert cache.extend(0, a, prompt) == [0, 1, 2]
    assert cache.extend(1, b, prompt) == []  # same keys already cached in a's blocks
    assert not any(cache.is_cached(x) for x in b)
    # b's cut drops nothing of a's.
    assert cache.cut(1, b, 0) == 0 and all(cache.is_cached(x) for x in a[:3])


def test_release_validates_references():
    pool = BlockPool(4, B)
    cache = PrefixCache(pool)
    blocks = start(cache, 0, list(range(5)))
    refs = list(pool.ref_counts)
    for bad in ([0, 0], [3], [9]):
        with pytest.raises(ValueError, match="released more times"):
            cache.release(bad)
        assert pool.ref_counts == refs
    with pytest.raises(KeyError, match="not in the prefix cache"):
        cache.end(7, blocks)
    with pytest.raises(ValueError, match="already began"):
        cache.begin(0, [1])


def test_clear_returns_the_pool_to_full():
    pool = BlockPool(6, B)
    cache = PrefixCache(pool)
    cache.end(0, start(cache, 0, list(range(17))))
    assert cache.clear() == 4 and pool.num_free == 6 and not cache.key_of
    cache.check_integrity()
    pool.check_integrity()


def test_check_integrity_finds_a_cached_block_missing_from_the_lru():
    pool = BlockPool(4, B)
    cache = PrefixCache(pool)
    cache.end(0, start(cache, 0, list(range(5))))
    cache.unheld.clear()
    with pytest.raises(RuntimeError, match="LRU"):
        cache.check_integrity()


def test_shared_set_follows_the_holders():
    pool = BlockPool(8, B)
    cache = PrefixCache(pool)
    a = start(cache, 0, list(range(9)))
    b = start(cache, 1, list(range(9)))
    assert cache.shared == {0, 1}
    cache.end(0, a)
    assert cache.shared == set()
    cache.check_integrity()
    cache.end(1, b)
    cache.check_integrity()


def test_payload_lives_and_dies_with_the_key():
    pool = BlockPool(3, B)
    cache = PrefixCache(pool)
    blocks = start(cache, 0, list(range(9)))
    cache.attach(blocks[1], "mass")
    with pytest.raises(ValueError, match="holds no key"):
        cache.attach(blocks[2], "mass")
    assert cache.payload == {blocks[1]: "mass"}
    cache.cut(0, blocks, 4)
    assert cache.payload == {}
    cache.check_integrity()
