from __future__ import annotations

import pytest

from kvservice.core.kv_cache_manager import KVCacheManager, cdiv
from kvservice.core.request import Request
from kvservice.core.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int) -> Request:
    return Request(request_id, list(range(num_prompt_tokens)), SamplingParams(max_tokens=8))


@pytest.mark.parametrize(("a", "b", "expected"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 4, 9)])
def test_cdiv(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_allocate_covers_exactly_the_tokens(num_tokens: int, num_blocks: int) -> None:
    kv = KVCacheManager(8, 16)
    request = make_request("a", num_tokens)
    block_ids = kv.allocate_slots(request, num_tokens)
    assert block_ids is not None and len(block_ids) == num_blocks
    assert kv.num_free_blocks == 8 - num_blocks
    assert kv.get_block_ids("a") == block_ids


def test_table_grows_only_when_a_block_fills() -> None:
    kv = KVCacheManager(8, 4)
    request = make_request("a", 6)
    table = kv.allocate_slots(request, 6)
    assert table is not None and len(table) == 2
    first_two = list(table)
    request.num_computed_tokens = 6
    for num_computed, expected_len in [(6, 2), (7, 2), (8, 3), (9, 3)]:
        request.num_computed_tokens = num_computed
        table = kv.allocate_slots(request, 1)
        assert table is not None and len(table) == expected_len
    assert table[:2] == first_two
    assert kv.num_free_blocks == 5


def test_short_pool_returns_none_and_keeps_the_existing_table() -> None:
    kv = KVCacheManager(3, 4)
    a = make_request("a", 8)
    b = make_request("b", 4)
    assert kv.allocate_slots(a, 8) is not None
    table_b = kv.allocate_slots(b, 4)
    assert table_b is not None
    saved = list(table_b)
    b.num_computed_tokens = 4
    assert kv.allocate_slots(b, 1) is None
    assert kv.get_block_ids("b") == saved
    assert kv.num_free_blocks == 0


def test_short_pool_for_a_new_request_leaves_no_table() -> None:
    kv = KVCacheManager(2, 4)
    assert kv.allocate_slots(make_request("a", 12), 12) is None
    assert kv.get_block_ids("a") == []
    assert "a" not in kv.block_tables
    assert kv.num_free_blocks == 2


def test_free_returns_every_block_and_is_idempotent() -> None:
    kv = KVCacheManager(6, 4)
    assert kv.allocate_slots(make_request("a", 10), 10) is not None
    assert kv.allocate_slots(make_request("b", 5), 5) is not None
    assert kv.num_free_blocks == 1
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert kv.get_block_ids("a") == []
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 4
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks == 6


def test_tables_of_live_requests_never_share_a_block() -> None:
    kv = KVCacheManager(10, 2)
    tables = {}
    for i, n in enumerate([3, 5, 1, 6, 2]):
        table = kv.allocate_slots(make_request(f"r{i}", n), n)
        assert table is not None
        tables[f"r{i}"] = table
    all_ids = [b for t in tables.values() for b in t]
    assert len(all_ids) == len(set(all_ids)) == 10
