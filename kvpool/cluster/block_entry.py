"""One entry of a node's block table (kvpool.cluster.block_table): a block range and its state;
the entries by offset (``EntriesByOffset``) and the table's lock (``Waits``).

States: ``CLAIMED`` (a write is being made), ``WRITTEN`` (whole, key known to
the node), ``COMMITTED`` (the master made it visible, or it was re-registered).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Any

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
    queries). Invariant: entries come and go only through ``add`` and ``discard``,
    and ``add`` is only called for a free offset, so both views hold the same set."""

    def __init__(self) -> None:
        super().__init__()
        self._sorted: list[int] = []

    def add(self, entry: Entry) -> None:
        offset = entry.stamp.offset
        self[offset] = entry
        bisect.insort(self._sorted, offset)

    def discard(self, entry: Entry) -> bool:
        """Remove ``entry`` if it is the one at its offset; whether it was."""
        offset = entry.stamp.offset
        if self.get(offset) is not entry:
            return False
        del self[offset]
        del self._sorted[bisect.bisect_left(self._sorted, offset)]
        return True

    def overlapping(self, offset: int, size: int) -> list[Entry]:
        """The entries sharing a byte with ``[offset, offset + size)``, by offset."""
        offsets = self._sorted
        i = bisect.bisect_right(offsets, offset)
        found = []
        if i and (before := self[offsets[i - 1]]).stamp.offset + before.stamp.size > offset:
            found.append(before)
        end = offset + size
        while i < len(offsets) and offsets[i] < end:
            found.append(self[offsets[i]])
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
