"""Best-fit extent allocator over a fixed address range [0, capacity).

Used for the DRAM and GPU arenas and for the SSD data file: memory is carved
up front, so a put never allocates from the heap, only picks an extent here.

Invariants (checked by ``check()``, exercised by property tests):
- every extent starts and ends on a multiple of ``alignment``;
- used and free extents never overlap and together cover [0, capacity);
- no two free extents touch (frees coalesce with both neighbours);
- ``used_bytes + free_bytes == capacity``.
Allocation picks the smallest free extent that fits, lowest offset on ties,
which keeps big holes intact for big blocks. Every operation is O(log n) for
the search plus O(n) list shifts over the n free extents (small in practice).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort


class ExtentAllocator:
    """Hands out aligned extents; not thread-safe (callers hold their lock)."""

    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.alignment = alignment
        self._mask = alignment - 1  # round_up as (size + mask) & ~mask, inlined on hot paths
        self.capacity = capacity - capacity % alignment
        self._used: dict[int, int] = {}  # offset -> size
        self._free: dict[int, int] = {}  # offset -> size
        self._free_ends: dict[int, int] = {}  # end -> offset, to coalesce leftwards
        self._free_offsets: list[int] = []  # sorted, to find neighbours
        self._by_size: list[tuple[int, int]] = []  # sorted (size, offset), for best fit
        self.used_bytes = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    # -- public API -------------------------------------------------------

    def round_up(self, size: int) -> int:
        return (size + self._mask) & ~self._mask

    def allocate(self, size: int) -> int | None:
        """Offset of a fresh extent of ``round_up(size)`` bytes, or None if none fits."""
        if size <= 0:
            raise ValueError(f"allocation size must be > 0, got {size}")
        need = (size + self._mask) & ~self._mask
        by_size = self._by_size
        i = bisect_left(by_size, (need, -1))
        if i == len(by_size):
            return None
        free_size, offset = by_size[i]
        if free_size > need:  # split: the rest keeps the extent's place in offset order
            rest, rest_size = offset + need, free_size - need
            free = self._free
            del free[offset]
            free[rest] = rest_size
            self._free_ends[offset + free_size] = rest
            self._free_offsets[bisect_left(self._free_offsets, offset)] = rest
            entry = (rest_size, rest)
            if i == 0 or by_size[i - 1] < entry:  # still in order: replace in place
                by_size[i] = entry
            else:
                del by_size[i]
                insort(by_size, entry, 0, i)  # smaller: at or before i
        else:
            self._remove_free(offset)
        self._used[offset] = need
        self.used_bytes += need
        return offset

    def reserve(self, offset: int, size: int) -> None:
        """Mark exactly [offset, offset+round_up(size)) used (rebuilding after reopen).

        ValueError if the range is misaligned or not entirely free.
        """
        need = self.round_up(size)
        if offset % self.alignment or size <= 0:
            raise ValueError(f"cannot reserve misaligned extent {offset}+{size}")
        i = bisect_right(self._free_offsets, offset) - 1
        if i < 0:
            raise ValueError(f"extent {offset}+{need} is not free")
        start = self._free_offsets[i]
        length = self._free[start]
        if offset + need > start + length:
            raise ValueError(f"extent {offset}+{need} is not free")
        self._remove_free(start)
        if offset > start:
            self._add_free(start, offset - start)
        if start + length > offset + need:
            self._add_free(offset + need, start + length - offset - need)
        self._used[offset] = need
        self.used_bytes += need

    def free(self, offset: int) -> int:
        """Release the extent at ``offset``; returns its size. KeyError if not allocated."""
        size = self._used.pop(offset)
        self.used_bytes -= size
        start, end = offset, offset + size
        left = self._free_ends.get(start)
        right = end in self._free
        if left is None:
            if right:  # grows the free extent on its right leftwards
                self._grow_left(end, start)
            else:
                self._add_free(start, size)
            return size
        if right:  # joins both neighbours
            right_size = self._free[end]
            self._remove_free(end)
            end += right_size
        self._grow_right(left, end)
        return size

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def check(self) -> None:
        """Assert every invariant in the module docstring (for tests)."""
        extents = sorted(
            [(o, s, "used") for o, s in self._used.items()]
            + [(o, s, "free") for o, s in self._free.items()]
        )
        position, last_kind = 0, None
        for offset, size, kind in extents:
            assert offset == position, f"gap or overlap at {position}"
            assert offset % self.alignment == 0 and size % self.alignment == 0 and size > 0
            assert not (kind == "free" and last_kind == "free"), "uncoalesced free extents"
            position, last_kind = offset + size, kind
        assert position == self.capacity
        assert self.used_bytes == sum(self._used.values())
        assert self._free_offsets == sorted(self._free)
        assert self._by_size == sorted((s, o) for o, s in self._free.items())
        assert self._free_ends == {o + s: o for o, s in self._free.items()}

    # -- helpers ----------------------------------------------------------

    def _add_free(self, offset: int, size: int) -> None:
        self._free[offset] = size
        self._free_ends[offset + size] = offset
        insort(self._free_offsets, offset)
        insort(self._by_size, (size, offset))

    def _grow_left(self, offset: int, start: int) -> None:
        """The free extent at ``offset`` now starts at ``start`` (< offset, no free
        extent in between): it keeps its place in offset order."""
        size = self._free.pop(offset)
        end = offset + size
        self._free[start] = end - start
        self._free_ends[end] = start
        self._free_offsets[bisect_left(self._free_offsets, offset)] = start
        del self._by_size[bisect_left(self._by_size, (size, offset))]
        insort(self._by_size, (end - start, start))

    def _grow_right(self, offset: int, end: int) -> None:
        """The free extent at ``offset`` now ends at ``end`` (no free extent in
        between): it keeps its offset, so only its size and end change."""
        free = self._free
        size = free[offset]
        del self._free_ends[offset + size]
        free[offset] = end - offset
        self._free_ends[end] = offset
        by_size = self._by_size
        del by_size[bisect_left(by_size, (size, offset))]
        insort(by_size, (end - offset, offset))

    def _remove_free(self, offset: int) -> None:
        size = self._free.pop(offset)
        del self._free_ends[offset + size]
        del self._free_offsets[bisect_left(self._free_offsets, offset)]
        del self._by_size[bisect_left(self._by_size, (size, offset))]
