from __future__ import annotations

import pytest

from kvservice.block_pool import BlockPool, KVCacheEvent


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


def test_reusing_a_hashed_block_reports_its_removal() -> None:
    pool = BlockPool(2)
    block_ids = pool.allocate(2)
    assert block_ids is not None
    pool.blocks[block_ids[0]].block_hash = 1234
    pool.free(block_ids)
    assert pool.take_events() == []
    pool.allocate(2)
    assert pool.take_events() == [KVCacheEvent("removed", (1234,))]
    assert pool.take_events() == []
    assert all(b.block_hash is None for b in pool.blocks)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_empty_pool_is_rejected(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)
