"""ExtentAllocator: exact best-fit choices and invariants under random use."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.storage.allocator import ExtentAllocator


def test_rounds_to_alignment_and_fills_exactly() -> None:
    alloc = ExtentAllocator(16 * 4096, alignment=4096)
    offsets = [alloc.allocate(1) for _ in range(16)]
    assert offsets == [i * 4096 for i in range(16)]
    assert alloc.allocate(1) is None
    assert alloc.free_bytes == 0
    alloc.check()


def test_best_fit_picks_the_smallest_hole_then_lowest_offset() -> None:
    alloc = ExtentAllocator(10 * 4096)
    a, b, c, d, e = (alloc.allocate(n * 4096) for n in (1, 3, 1, 2, 1))
    assert (a, b, c, d, e) == (0, 4096, 4 * 4096, 5 * 4096, 7 * 4096)
    alloc.free(b)  # hole of 3 pages at 1
    alloc.free(d)  # hole of 2 pages at 5
    # 8..10 is a free tail of 2 pages: ties on size go to the lowest offset.
    assert alloc.allocate(2 * 4096) == 5 * 4096
    assert alloc.allocate(2 * 4096) == 8 * 4096
    assert alloc.allocate(3 * 4096) == 4096
    alloc.check()


def test_free_coalesces_both_neighbours() -> None:
    alloc = ExtentAllocator(3 * 4096)
    a, b, c = (alloc.allocate(4096) for _ in range(3))
    assert None not in (a, b, c)
    alloc.free(a)  # type: ignore[arg-type]
    alloc.free(c)  # type: ignore[arg-type]
    alloc.free(b)  # type: ignore[arg-type]
    assert alloc.largest_free == 3 * 4096
    assert alloc.allocate(3 * 4096) == 0
    alloc.check()


def test_reserve_rebuilds_known_extents() -> None:
    alloc = ExtentAllocator(8 * 4096)
    alloc.reserve(2 * 4096, 4096)
    alloc.reserve(5 * 4096, 2 * 4096)
    alloc.check()
    with pytest.raises(ValueError):
        alloc.reserve(2 * 4096, 4096)  # already used
    with pytest.raises(ValueError):
        alloc.reserve(100, 4096)  # misaligned
    assert alloc.allocate(2 * 4096) == 0
    assert alloc.used_bytes == 5 * 4096


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ExtentAllocator(4096, alignment=3000)
    alloc = ExtentAllocator(4096)
    with pytest.raises(ValueError):
        alloc.allocate(0)
    with pytest.raises(KeyError):
        alloc.free(0)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences never overlap and always account exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ExtentAllocator(64 * 512, alignment=512)
        self.live: dict[int, int] = {}

    @rule(size=st.integers(1, 20 * 512))
    def allocate(self, size: int) -> None:
        offset = self.alloc.allocate(size)
        rounded = -(-size // 512) * 512
        if offset is None:
            assert self.alloc.largest_free < rounded
            return
        for other, other_size in self.live.items():
            assert offset + rounded <= other or other + other_size <= offset
        self.live[offset] = rounded

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        assert self.alloc.free(offset) == self.live.pop(offset)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()
        assert self.alloc.used_bytes == sum(self.live.values())


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
