"""One entry of a node's block table (kvpool.cluster.block_table): a block range and its state;
the entries by offset (``EntriesByOffset``) and the table's lock (``Waits``).

States: ``CLAIMED`` (a write is being made), ``WRITTEN`` (whole, key known to
the node), ``COMMITTED`` (the master made it visible, or it was re-registered).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

from kvpool.transport.fencing import WriteStamp

CLAIMED, WRITTEN, COMMITTED = "claimed", "written", "committed"
NO_KEY = bytes(16)  # the placeholder key of a claim taken ahead for a grant


@dataclass(eq=False)
class Entry:
    stamp: WriteStamp
    state: str
    inflight: int = 0  # reads and writes holding the range now
    aborted: bool = False
    checksum: int = 0  # xxh3_64 of the bytes once known (0: not computed yet)
    granted_ns: int = 0  # when a claim sealable in shared memory was granted (0: not one)

    def serves(self, key: bytes, offset: int, length: int) -> bool:
        """Whether a checked read of ``[offset, offset + length)`` as block ``key`` may be
        served from this entry: that block's, whole (not a claim), not aborted, covering
        the range."""
        s = self.stamp
        return (
            s.key == key
            and self.state != CLAIMED
            and not self.aborted
            and s.offset <= offset
            and offset + length <= s.offset + s.size
        )

    def is_allocation(self, alloc_id: int, epoch: int) -> bool:
        """Whether this entry is exactly allocation ``alloc_id`` of term ``epoch``."""
        s = self.stamp
        return alloc_id != 0 and s.alloc_id == alloc_id and s.epoch == epoch

    def named_by(self, alloc_id: int, epoch: int) -> bool:
        """Whether a heartbeat event of term ``epoch`` about allocation ``alloc_id`` is
        about this entry. Allocation ids are unique within a term; an entry of an older
        term (a block re-registered with this master) is known to it as 0. Either side
        0 (unknown: an old master, a restored block) falls back to the range."""
        return alloc_id == 0 or self.stamp.alloc_id == 0 or self.is_allocation(alloc_id, epoch)

    def wire(self) -> list[Any]:
        """As a registration reports it: [key, offset, size, checksum, parent, confirmed]
        (confirmed: a master made it visible; else only written whole)."""
        s = self.stamp
        return [s.key, s.offset, s.size, self.checksum, s.parent, self.state == COMMITTED]


class EntriesByOffset(dict[int, Entry]):
    """The table's entries by block offset, the offsets also kept sorted (overlap
    queries), and how many of them are whole (not ``CLAIMED``) and their bytes.

    Invariants (``check``): entries come and go only through ``add`` and
    ``discard``, and ``add`` is only called for a free offset, so both views hold
    the same set; a held entry's state changes only through ``set_state``, so
    ``whole_bytes`` / ``whole_count`` are always those of the entries not claimed.

    Why counts: the node's gauges read them every heartbeat; scanning every entry
    for them (under the table's lock, adopting seals on the way) took 68% of the
    node's Python time at 600k blocks and held every claim, seal and read that long
    (issue 17, session 38). Why a ``SortedList`` (O(log n) per insert and delete),
    not a plain list kept sorted with ``bisect.insort``: that shifted every later
    offset on each put and each free at a random offset (a remove, an eviction's
    hole refilled): the table's free + claim + seal + commit there took 164 us at
    600k blocks against 26 (15-17 us either way at 16k blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self._sorted = SortedList()
        self.whole_bytes = 0
        self.whole_count = 0

    def add(self, entry: Entry) -> None:
        offset = entry.stamp.offset
        self[offset] = entry
        self._sorted.add(offset)
        if entry.state != CLAIMED:
            self._count(entry, 1)

    def discard(self, entry: Entry) -> bool:
        """Remove ``entry`` if it is the one at its offset; whether it was."""
        offset = entry.stamp.offset
        if self.get(offset) is not entry:
            return False
        del self[offset]
        self._sorted.remove(offset)
        if entry.state != CLAIMED:
            self._count(entry, -1)
        return True

    def set_state(self, entry: Entry, state: str) -> None:
        """``entry.state = state``, counted if ``entry`` is held here."""
        was_whole, entry.state = entry.state != CLAIMED, state
        if was_whole != (state != CLAIMED) and self.get(entry.stamp.offset) is entry:
            self._count(entry, -1 if was_whole else 1)

    def check(self) -> None:
        """Raise AssertionError unless the invariants hold (tests)."""
        assert list(self._sorted) == sorted(self)
        whole = [e.stamp.size for e in self.values() if e.state != CLAIMED]
        assert (self.whole_bytes, self.whole_count) == (sum(whole), len(whole))

    def _count(self, entry: Entry, sign: int) -> None:
        self.whole_bytes += sign * entry.stamp.size
        self.whole_count += sign

    def overlapping(self, offset: int, size: int) -> list[Entry]:
        """The entries sharing a byte with ``[offset, offset + size)``, by offset."""
        offsets = self._sorted
        i = offsets.bisect_right(offset)
        found = []
        if i and (before := self[offsets[i - 1]]).stamp.offset + before.stamp.size > offset:
            found.append(before)
        end, count = offset + size, len(offsets)
        while i < count and (at := offsets[i]) < end:  # (a loop: no generator to set up)
            found.append(self[at])
            i += 1
        return found


class Waits:
    """The block table's lock and condition, counting the threads that wait on it
    (a newer claim for a read or write in flight, ``take_over``, ``new_term``):
    ``notify_all`` is skipped when none waits, so ending a read (the node's hot
    path) costs one plain lock. The count changes only under the lock: a waiter
    counts itself before ``wait`` releases it, and rechecks after it wakes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # never re-entered
        self.cond = threading.Condition(self.lock)
        self.waiting = 0

    def wait(self, timeout: float) -> None:
        self.waiting += 1
        try:
            self.cond.wait(timeout)
        finally:
            self.waiting -= 1

    def notify_all(self) -> None:
        if self.waiting:
            self.cond.notify_all()
