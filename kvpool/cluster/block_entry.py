"""One entry of a node's block table (kvpool.cluster.block_table): a block range and its state.

States: ``CLAIMED`` (a write is being made), ``WRITTEN`` (whole, key known to
the node), ``COMMITTED`` (the master made it visible, or it was re-registered).
"""

from __future__ import annotations

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

    def wire(self) -> list[Any]:
        """As a registration reports it: [key, offset, size, checksum, parent]."""
        s = self.stamp
        return [s.key, s.offset, s.size, self.checksum, s.parent]


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
