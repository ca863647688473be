"""Page allocator for one arena: best-fit over 4 KiB pages with coalescing of free neighbours.

Chunk objects are a few hundred KiB to a few MiB and mostly of a handful of sizes (one per model
layout), so best-fit over page-rounded sizes wastes little (< one page per object) and the free
list stays short; a buddy allocator would round a 5.9 MiB SmolLM2 chunk up to 8 MiB.

Invariants (property-tested in tests/kvpool/tiers/test_allocator.py):
- allocated ranges never overlap each other nor any free range, and all lie inside the arena;
- free ranges are maximal: no two free ranges touch (they are merged on free);
- allocated pages + free pages == total pages, so freeing everything leaves one free range
  covering the whole arena.
Not thread-safe: the owner (a tier, under its store's lock) serializes calls.
"""

from __future__ import annotations

import bisect

from kvpool.errors import InvalidArgument

PAGE = 4096


def pages_for(nbytes: int, page: int = PAGE) -> int:
    return max(1, -(-nbytes // page))


class PageAllocator:
    """Hands out page-aligned byte offsets into an arena of `size` bytes (rounded down to pages)."""

    def __init__(self, size: int, page: int = PAGE):
        if size < page:
            raise InvalidArgument(f"arena of {size} bytes is smaller than one {page}-byte page")
        self.page = page
        self.total_pages = size // page
        # Free ranges, all in pages: start -> length, end -> start, and (length, start) sorted
        # so the smallest fitting range (lowest address on ties) is one bisect away.
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._free_sorted: list[tuple[int, int]] = []
        self._allocated: dict[int, int] = {}  # start page -> length in pages
        self.used_pages = 0
        self._add_free(0, self.total_pages)

    @property
    def capacity(self) -> int:
        return self.total_pages * self.page

    @property
    def used(self) -> int:
        return self.used_pages * self.page

    def largest_free(self) -> int:
        """Bytes of the largest contiguous free range."""
        return self._free_sorted[-1][0] * self.page if self._free_sorted else 0

    def alloc(self, nbytes: int) -> int | None:
        """Byte offset of a fresh range of at least `nbytes`, or None if no free range fits."""
        if nbytes <= 0:
            raise InvalidArgument(f"allocation size must be positive, got {nbytes}")
        want = pages_for(nbytes, self.page)
        i = bisect.bisect_left(self._free_sorted, (want, -1))
        if i == len(self._free_sorted):
            return None
        length, start = self._free_sorted[i]
        self._remove_free(start, length, index=i)
        if length > want:
            self._add_free(start + want, length - want)
        self._allocated[start] = want
        self.used_pages += want
        return start * self.page

    def free(self, offset: int) -> None:
        """Return the range that `alloc` handed out at `offset`; neighbours are merged."""
        start, rem = divmod(offset, self.page)
        length = self._allocated.pop(start, None) if rem == 0 else None
        if length is None:
            raise InvalidArgument(f"offset {offset} is not an allocated range")
        self.used_pages -= length
        end = start + length
        after = self._free_by_start.get(end)
        if after is not None:
            self._remove_free(end, after)
            length += after
        before = self._free_by_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            length += start - before
            start = before
        self._add_free(start, length)

    def size_of(self, offset: int) -> int:
        """Bytes reserved for the allocation at `offset` (page-rounded)."""
        return self._allocated[offset // self.page] * self.page

    def allocations(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of every live allocation, for tests and stats."""
        return [(s * self.page, n * self.page) for s, n in sorted(self._allocated.items())]

    def free_ranges(self) -> list[tuple[int, int]]:
        return [(s * self.page, n * self.page) for s, n in sorted(self._free_by_start.items())]

    def _add_free(self, start: int, length: int) -> None:
        self._free_by_start[start] = length
        self._free_by_end[start + length] = start
        bisect.insort(self._free_sorted, (length, start))

    def _remove_free(self, start: int, length: int, index: int | None = None) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + length]
        if index is None:
            index = bisect.bisect_left(self._free_sorted, (length, start))
        del self._free_sorted[index]
