"""Property tests of the page allocator: no overlaps, everything returned when all is freed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import InvalidArgument
from kvpool.tiers.allocator import PageAllocator

PAGE = 4096

# A program: positive sizes allocate, negative numbers free the i-th live allocation.
ops = st.lists(st.one_of(st.integers(1, 64 * PAGE), st.integers(-1000, -1)), max_size=200)


def _check(alloc: PageAllocator) -> None:
    ranges = sorted([(o, n, "a") for o, n in alloc.allocations()] + [(o, n, "f") for o, n in alloc.free_ranges()])
    pos = 0
    for offset, length, kind in ranges:
        assert offset == pos, "allocated/free ranges must tile the arena without gaps or overlaps"
        assert offset % PAGE == 0 and length > 0
        pos = offset + length
    assert pos == alloc.capacity
    free = alloc.free_ranges()
    for (o1, n1), (o2, _) in zip(free, free[1:]):
        assert o1 + n1 < o2, "adjacent free ranges must have been merged"
    assert alloc.used == sum(n for _, n in alloc.allocations()) <= alloc.capacity


@settings(max_examples=150, deadline=None)
@given(total_pages=st.integers(1, 256), program=ops)
def test_never_overlaps_and_returns_everything(total_pages, program):
    alloc = PageAllocator(total_pages * PAGE)
    live: list[tuple[int, int]] = []
    for op in program:
        if op > 0:
            offset = alloc.alloc(op)
            if offset is None:
                assert alloc.largest_free() < op
            else:
                assert alloc.size_of(offset) >= op
                live.append((offset, op))
        elif live:
            offset, _ = live.pop((-op) % len(live))
            alloc.free(offset)
        _check(alloc)
    for offset, _ in live:
        alloc.free(offset)
    assert alloc.used == 0
    assert alloc.free_ranges() == [(0, alloc.capacity)]


def test_best_fit_reuses_holes():
    alloc = PageAllocator(16 * PAGE)
    a = alloc.alloc(4 * PAGE)
    b = alloc.alloc(PAGE)
    alloc.alloc(4 * PAGE)
    alloc.free(b)
    assert alloc.alloc(PAGE) == b  # the one-page hole, not the big tail
    alloc.free(a)
    # Free now: the 4-page hole at 0 and the 7-page tail; no 8 contiguous pages anywhere.
    assert alloc.largest_free() == 7 * PAGE
    assert alloc.alloc(8 * PAGE) is None
    assert alloc.alloc(4 * PAGE) == a  # best fit: the hole that fits exactly, not the tail
    assert alloc.largest_free() == 7 * PAGE


def test_bad_calls():
    alloc = PageAllocator(4 * PAGE)
    with pytest.raises(InvalidArgument):
        alloc.alloc(0)
    with pytest.raises(InvalidArgument):
        alloc.free(123)
    off = alloc.alloc(10)
    alloc.free(off)
    with pytest.raises(InvalidArgument):
        alloc.free(off)  # double free is caught, not silently corrupting the free list
    with pytest.raises(InvalidArgument):
        PageAllocator(100)
