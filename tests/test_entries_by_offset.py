"""EntriesByOffset: the block table's entries by offset, overlap queries, whole counts.

A hypothesis state machine adds and discards entries of non-overlapping ranges
(as the table keeps them), moves them between states, and checks every overlap
query, in order, against a scan of all entries, and the whole-block counts
(``check``) after every step; plus exact cases at the edges of a range.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.cluster.block_entry import CLAIMED, COMMITTED, WRITTEN, EntriesByOffset, Entry
from kvpool.transport.fencing import WriteStamp

SLOTS = 64  # the region: 64 slots of 16 bytes; entries span 1-4 slots


def entry(offset: int, size: int) -> Entry:
    return Entry(WriteStamp(1, offset + 1, offset, size, bytes(16)), CLAIMED)


def test_overlapping_at_the_edges_of_ranges() -> None:
    entries = EntriesByOffset()
    a, b, c = entry(0, 16), entry(16, 32), entry(64, 16)
    for e in (c, a, b):
        entries.add(e)
    assert entries.overlapping(0, 16) == [a]
    assert entries.overlapping(15, 2) == [a, b]
    assert entries.overlapping(47, 1) == [b]
    assert entries.overlapping(48, 16) == []  # the gap: ends where c starts
    assert entries.overlapping(48, 17) == [c]
    assert entries.overlapping(0, 1 << 20) == [a, b, c]
    assert entries.overlapping(80, 16) == []
    assert entries.discard(b) and not entries.discard(b)
    assert entries.overlapping(0, 1 << 20) == [a, c]
    assert not entries.discard(entry(0, 16))  # another entry at a's offset: not a
    assert entries[0] is a


def test_whole_counts_follow_states_of_held_entries_only() -> None:
    entries = EntriesByOffset()
    a, b = entry(0, 16), entry(16, 32)
    entries.add(a)
    entries.add(b)
    assert (entries.whole_bytes, entries.whole_count) == (0, 0)  # both claimed
    entries.set_state(b, WRITTEN)
    entries.set_state(b, COMMITTED)  # whole to whole: counted once
    assert (entries.whole_bytes, entries.whole_count) == (32, 1)
    entries.discard(b)
    assert (entries.whole_bytes, entries.whole_count) == (0, 0)
    entries.set_state(b, CLAIMED)  # not held any more: nothing to count
    entries.add(entry(16, 32))
    whole = entry(64, 16)
    whole.state = WRITTEN
    entries.add(whole)  # added whole (an SSD load)
    assert (entries.whole_bytes, entries.whole_count) == (16, 1)
    entries.check()


class EntriesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.entries = EntriesByOffset()
        self.model: list[Entry] = []

    def _free(self, offset: int, size: int) -> bool:
        return all(
            e.stamp.offset + e.stamp.size <= offset or offset + size <= e.stamp.offset
            for e in self.model
        )

    @rule(
        slot=st.integers(0, SLOTS - 1),
        slots=st.integers(1, 4),
        state=st.sampled_from([CLAIMED, WRITTEN]),
    )
    def add(self, slot: int, slots: int, state: str) -> None:
        offset, size = slot * 16, min(slots, SLOTS - slot) * 16
        if self._free(offset, size):
            e = entry(offset, size)
            e.state = state
            self.entries.add(e)
            self.model.append(e)

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        if self.model:
            e = data.draw(st.sampled_from(self.model))
            assert self.entries.discard(e)
            self.model.remove(e)

    @rule(data=st.data(), state=st.sampled_from([CLAIMED, WRITTEN, COMMITTED]))
    def set_state(self, data: st.DataObject, state: str) -> None:
        if self.model:
            self.entries.set_state(data.draw(st.sampled_from(self.model)), state)

    @rule(offset=st.integers(0, SLOTS * 16), size=st.integers(1, SLOTS * 16))
    def overlapping(self, offset: int, size: int) -> None:
        want = sorted(
            (
                e
                for e in self.model
                if e.stamp.offset < offset + size and offset < e.stamp.offset + e.stamp.size
            ),
            key=lambda e: e.stamp.offset,
        )
        assert self.entries.overlapping(offset, size) == want

    @invariant()
    def same_set(self) -> None:
        assert sorted(self.entries) == sorted(e.stamp.offset for e in self.model)
        self.entries.check()


EntriesMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_entries_by_offset = EntriesMachine.TestCase
