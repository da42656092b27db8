from __future__ import annotations

import pytest

from kvservice.core.block_pool import BlockPool, KVCacheEvent


def test_allocate_takes_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert a is not None and b is not None
    assert len(set(a) | set(b)) == 8
    assert all(pool.blocks[i].ref_cnt == 1 for i in a + b)
    assert pool.num_free_blocks == 0


def test_allocate_when_short_returns_none_and_takes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    assert held is not None
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert [b.ref_cnt for b in pool.blocks].count(0) == 1
    # The one free block is still there to take.
    assert pool.allocate(1) is not None
    assert pool.num_free_blocks == 0


def test_allocate_zero_blocks_is_empty() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_free_returns_blocks_and_they_can_be_reused() -> None:
    pool = BlockPool(4)
    first = pool.allocate(4)
    assert first is not None
    pool.free(first)
    assert pool.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    again = pool.allocate(4)
    assert again is not None and sorted(again) == sorted(first)


def test_shared_block_stays_taken_until_its_last_reference_is_freed() -> None:
    pool = BlockPool(4)
    block_ids = pool.allocate(2)
    assert block_ids is not None
    pool.touch(block_ids)
    assert [pool.blocks[i].ref_cnt for i in block_ids] == [2, 2]
    pool.free(block_ids)
    assert pool.num_free_blocks == 2
    pool.free(block_ids)
    assert pool.num_free_blocks == 4


def test_touch_revives_a_free_block() -> None:
    pool = BlockPool(3)
    block_ids = pool.allocate(1)
    assert block_ids is not None
    pool.free(block_ids)
    pool.touch(block_ids)
    assert pool.num_free_blocks == 2
    assert pool.blocks[block_ids[0]].ref_cnt == 1
    taken = pool.allocate(2)
    assert taken is not None and block_ids[0] not in taken


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    block_ids = pool.allocate(1)
    assert block_ids is not None
    pool.free(block_ids)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(block_ids)
    assert pool.num_free_blocks == 2


def test_least_recently_freed_block_is_reused_first() -> None:
    pool = BlockPool(4)
    block_ids = pool.allocate(4)
    assert block_ids is not None
    pool.free([block_ids[2]])
    pool.free([block_ids[0]])
    pool.free([block_ids[3]])
    assert pool.allocate(3) == [block_ids[2], block_ids[0], block_ids[3]]


def _cached_pool(num_blocks: int) -> tuple[BlockPool, list[int]]:
    """A pool whose blocks are all taken, events on."""
    pool = BlockPool(num_blocks)
    pool.record_events = True
    block_ids = pool.allocate(num_blocks)
    assert block_ids is not None
    return pool, block_ids


def test_cached_blocks_chain_into_one_stored_event_and_stay_findable_when_free() -> None:
    pool, ids = _cached_pool(4)
    assert pool.cache_block(ids[0], 11, parent_hash=7)
    assert pool.cache_block(ids[1], 12, parent_hash=11)
    assert pool.cache_block(ids[2], 99, parent_hash=5)  # another chain
    assert pool.take_events() == [KVCacheEvent("stored", (11, 12), 7), KVCacheEvent("stored", (99,), 5)]
    pool.free(ids)
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(12) == ids[1]
    pool.touch([ids[1]])  # a hit takes it back out of the free queue
    assert pool.num_free_blocks == 3 and pool.blocks[ids[1]].ref_cnt == 1


def test_never_cached_blocks_go_first_then_cached_ones_least_recently_freed_first() -> None:
    pool, ids = _cached_pool(4)
    for block_id, block_hash in zip(ids[:3], (1, 2, 3)):
        pool.cache_block(block_id, block_hash, parent_hash=0)
    pool.take_events()
    pool.free([ids[2]])
    pool.free([ids[0]])
    pool.free([ids[3]])  # not cached
    pool.free([ids[1]])
    assert pool.allocate(1) == [ids[3]]
    assert pool.take_events() == []
    assert pool.allocate(2) == [ids[2], ids[0]]
    assert pool.take_events() == [KVCacheEvent("removed", (3, 1))]
    assert pool.get_cached_block(3) is None and pool.get_cached_block(2) == ids[1]
    assert [pool.blocks[i].block_hash for i in (ids[2], ids[0])] == [None, None]


def test_a_hash_is_cached_once_and_not_at_all_with_caching_off() -> None:
    pool, ids = _cached_pool(2)
    assert pool.cache_block(ids[0], 5, parent_hash=0)
    assert not pool.cache_block(ids[1], 5, parent_hash=0)
    assert pool.get_cached_block(5) == ids[0] and pool.blocks[ids[1]].block_hash is None
    off = BlockPool(1, enable_caching=False)
    taken = off.allocate(1)
    assert taken is not None and not off.cache_block(taken[0], 5, parent_hash=0)
    assert off.get_cached_block(5) is None and off.num_cached_blocks == 0


def test_snapshot_lists_every_cached_block_and_events_wait_for_a_taker() -> None:
    pool = BlockPool(3)
    ids = pool.allocate(3)
    assert ids is not None
    pool.cache_block(ids[0], 1, parent_hash=9)
    pool.cache_block(ids[1], 2, parent_hash=1)
    assert pool.take_events() == []  # nobody took events yet: none were kept
    assert sorted(pool.snapshot(), key=lambda e: e.block_hashes) == [
        KVCacheEvent("stored", (1,), 9),
        KVCacheEvent("stored", (2,), 1),
    ]


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_empty_pool_is_rejected(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)
