"""Blocks whole on a node whose commit the master has not confirmed yet, oldest first.

A block becomes ``WRITTEN`` when its writer seals it (a final TCP write, a
seal sent or written in shared memory): its bytes are whole and its key is
known. Its writer then commits it; the master confirms each commit to the
node in the next heartbeat's events (``COMMITTED``). A writer killed by a
signal after its put returned but before its commit left (the commit
thread's linger and round trip: the README's visibility rule) leaves the
block ``WRITTEN`` and invisible, although the put was acknowledged. A
re-registration with a new master would list it and make it visible; this
queue lets the node do the same without waiting for one: the node's commit
thread (kvpool.cluster.node_commits) commits, on the writer's behalf, every
block still unconfirmed ``age`` seconds after its seal.

Invariants:
- each entry is handed out at most once, in the order it was sealed;
- the queue holds at most the entries sealed within ``age`` plus the run of
  still-``WRITTEN`` ones at its head: each new seal first drops the head entries
  that are confirmed or replaced, so the queue stays small even where nobody
  asks for ``due`` (a table with no commit thread);
- ``due`` hands out only entries still in the table's place and still
  ``WRITTEN`` at that moment; the rest are dropped (confirmed by a commit
  event or a re-registration, or replaced by a newer allocation).
Not thread-safe: the block table calls it under its lock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from kvpool.cluster.block_entry import WRITTEN, Entry


class Unconfirmed:
    """Sealed entries with the time they were sealed, oldest first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queue: deque[tuple[float, Entry]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def sealed(self, entry: Entry, entries: dict[int, Entry]) -> None:
        """``entry`` just became whole (``WRITTEN``); ``entries``: the table's, by offset."""
        queue = self._queue
        while queue and not _still_written(queue[0][1], entries):
            queue.popleft()
        queue.append((self._clock(), entry))

    def due(self, age: float, entries: dict[int, Entry]) -> list[Entry]:
        """The entries sealed at least ``age`` seconds ago that still hold their place in
        ``entries`` (the table's, by offset) as ``WRITTEN``, not freed meanwhile (each
        once; the others sealed that long ago are forgotten)."""
        queue, cutoff, out = self._queue, self._clock() - age, []
        while queue and queue[0][0] <= cutoff:
            entry = queue.popleft()[1]
            if _still_written(entry, entries):
                out.append(entry)
        return out


def _still_written(entry: Entry, entries: dict[int, Entry]) -> bool:
    return entries.get(entry.stamp.offset) is entry and entry.state == WRITTEN and not entry.aborted
