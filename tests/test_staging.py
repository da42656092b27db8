"""Tests for kvservice.connector.staging: the bounded first-fit arena that holds staged KV."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.connector.staging import StagingBuffer, StagingPool
from kvservice.core.kv_cache_manager import cdiv

ALIGN = 256  # reservations are rounded up to this many bytes


def _ranges_overlap(a: StagingBuffer, b: StagingBuffer) -> bool:
    return a.offset < b.offset + b.num_bytes and b.offset < a.offset + a.num_bytes


def test_reservations_are_aligned_and_view_disjoint_parts_of_the_arena() -> None:
    pool = StagingPool(4 * ALIGN)
    a = pool.reserve(1)
    b = pool.reserve(ALIGN + 1)
    assert a is not None and b is not None
    assert (a.offset, a.num_bytes) == (0, ALIGN)
    assert (b.offset, b.num_bytes) == (ALIGN, 2 * ALIGN)
    assert a.tensor.dtype == torch.uint8 and a.tensor.numel() == a.num_bytes
    assert b.tensor.numel() == b.num_bytes
    # Writing one buffer never shows up in another.
    a.tensor.fill_(7)
    b.tensor.fill_(9)
    assert bool((a.tensor == 7).all()) and bool((b.tensor == 9).all())
    assert pool.bytes_in_use == 3 * ALIGN


def test_zero_byte_reservation_still_takes_one_aligned_unit() -> None:
    pool = StagingPool(ALIGN)
    buffer = pool.reserve(0)
    assert buffer is not None and buffer.num_bytes == ALIGN
    assert pool.reserve(1) is None


def test_pool_never_exceeds_its_bound() -> None:
    pool = StagingPool(3 * ALIGN)
    held = [pool.reserve(ALIGN) for _ in range(3)]
    assert all(b is not None for b in held)
    assert pool.bytes_in_use == pool.capacity_bytes
    assert pool.reserve(1) is None
    assert pool.bytes_in_use == pool.capacity_bytes  # a refused reservation takes nothing


def test_too_large_reservation_is_refused_and_fits_says_so() -> None:
    pool = StagingPool(2 * ALIGN)
    assert pool.fits(2 * ALIGN)
    assert not pool.fits(2 * ALIGN + 1)
    assert pool.reserve(2 * ALIGN + 1) is None
    assert pool.bytes_in_use == 0


def test_release_returns_exactly_the_buffer_bytes() -> None:
    pool = StagingPool(8 * ALIGN)
    a = pool.reserve(3 * ALIGN)
    b = pool.reserve(ALIGN)
    assert a is not None and b is not None
    assert pool.bytes_in_use == 4 * ALIGN
    pool.release(a)
    assert pool.bytes_in_use == ALIGN
    pool.release(b)
    assert pool.bytes_in_use == 0


def test_first_fit_reuses_the_lowest_hole_that_is_large_enough() -> None:
    pool = StagingPool(8 * ALIGN)
    a = pool.reserve(ALIGN)  # [0, 1)
    b = pool.reserve(2 * ALIGN)  # [1, 3)
    c = pool.reserve(ALIGN)  # [3, 4)
    assert a is not None and b is not None and c is not None
    pool.release(a)
    pool.release(b)  # coalesces with a's hole: [0, 3) is free
    # 2 units fit the hole at 0 (first fit), not the tail at 4.
    d = pool.reserve(2 * ALIGN)
    assert d is not None and d.offset == 0
    # 1 unit: the rest of the first hole, [2, 3).
    e = pool.reserve(ALIGN)
    assert e is not None and e.offset == 2 * ALIGN
    # Nothing left below c: the next one lands after it.
    f = pool.reserve(ALIGN)
    assert f is not None and f.offset == 4 * ALIGN


def test_first_fit_skips_holes_that_are_too_small() -> None:
    pool = StagingPool(8 * ALIGN)
    a = pool.reserve(ALIGN)  # [0, 1)
    b = pool.reserve(ALIGN)  # [1, 2)
    assert a is not None and b is not None
    pool.release(a)  # a one-unit hole at 0
    c = pool.reserve(2 * ALIGN)
    assert c is not None and c.offset == 2 * ALIGN


def test_releasing_in_any_order_coalesces_back_to_one_range() -> None:
    """After every buffer is back, one reservation of the whole capacity must succeed."""
    pool = StagingPool(6 * ALIGN)
    buffers = [pool.reserve(ALIGN) for _ in range(6)]
    assert all(b is not None for b in buffers)
    # Middle first, then its neighbours (coalesce with the next and the previous range).
    for i in (2, 4, 3, 0, 5, 1):
        pool.release(buffers[i])  # type: ignore[arg-type]
    whole = pool.reserve(6 * ALIGN)
    assert whole is not None and whole.offset == 0
    assert pool.bytes_in_use == pool.capacity_bytes


def _first_fit_offset(live: list[StagingBuffer], capacity: int, size: int) -> int | None:
    """Where a first-fit allocator must place `size` bytes, given the live buffers."""
    start = 0
    for buffer in sorted(live, key=lambda b: b.offset):
        if buffer.offset - start >= size:
            return start
        start = buffer.offset + buffer.num_bytes
    return start if capacity - start >= size else None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5 * ALIGN), st.integers(0, 50)), max_size=40))
def test_random_reserve_release_is_first_fit_bounded_and_disjoint(ops: list[tuple[bool, int, int]]) -> None:
    capacity = 8 * ALIGN
    pool = StagingPool(capacity)
    live: list[StagingBuffer] = []
    for is_reserve, num_bytes, pick in ops:
        if is_reserve or not live:
            size = max(ALIGN, cdiv(num_bytes, ALIGN) * ALIGN)
            expected = _first_fit_offset(live, capacity, size)
            buffer = pool.reserve(num_bytes)
            if expected is None:
                assert buffer is None  # no free range is large enough
                continue
            assert buffer is not None, f"{num_bytes} bytes fit at {expected} but were refused"
            assert (buffer.offset, buffer.num_bytes) == (expected, size)
            assert not any(_ranges_overlap(buffer, other) for other in live)
            live.append(buffer)
        else:
            pool.release(live.pop(pick % len(live)))
        assert pool.bytes_in_use == sum(b.num_bytes for b in live) <= capacity
    for buffer in live:
        pool.release(buffer)
    assert pool.bytes_in_use == 0
    assert pool.reserve(capacity) is not None  # fully coalesced


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        StagingPool(0)
