"""The writer's side of commits sent by the node: puts acknowledged, committed by their node.

A same-host put whose seal record asks its node to commit the block
(kvpool.transport.shm_seal ``NODE_COMMITS``; the node's side is
kvpool.cluster.node_commits) sends nothing to the master. The writer still
owes read-your-writes, so it keeps such puts here until their node answers
in the record: ``VISIBLE`` (committed, or the key was stored already) ends
the watch; ``NOT_COMMITTED``, a record reused for a later claim before it
was read, or no answer within ``ANSWER_S`` (a healthy node answers within
milliseconds: its node died, or its commit thread is stuck) hands the put to
``CommitPipe.settle`` (retry, look the key up, read back and put again). A
put settled so while its node still commits it is committed twice at worst:
the second commit finds no grant and the key already stored.

Invariants:
- every watched put is either still waiting (its record says
  ``NODE_COMMITS``), or forgotten because it is visible, or handed out to
  settle exactly once;
- the list is swept every ``SWEEP_EVERY`` new puts, so a client that only
  writes keeps at most the puts its nodes have not answered yet, plus that.

Bound for other clients: the node's poll period (``node_commits.IDLE_S``,
2 ms; 0.25 ms while puts stream) plus one master round trip.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvpool.transport.shm_seal import NODE_COMMITS, VISIBLE, SealRecords

if TYPE_CHECKING:
    from kvpool.cluster.client.commits import Acked

SWEEP_EVERY = 64  # watched puts between sweeps of the answers
ANSWER_S = 2.0  # a flush waits this long for its node's answers, then settles the rest
FIRST_PAUSE_S, LAST_PAUSE_S = 0.00005, 0.002  # a waiting flush polls the records so


class NodeWatch:
    """The puts of one client whose node sends their commit (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.watched: list[tuple[Acked, SealRecords]] = []
        self._sweep_at = SWEEP_EVERY
        self.count = 0  # puts watched so far

    def watch(self, item: Acked, records: SealRecords) -> list[Acked]:
        """Watch ``item``, sealed in ``records``; returns puts to settle (a sweep's)."""
        lock = self._lock
        lock.acquire()  # not ``with``: every same-host put comes here (~0.1 us less)
        try:
            self.watched.append((item, records))
            self.count += 1
            if len(self.watched) < self._sweep_at:
                return []
            unsure = self._sweep()
            self._sweep_at = len(self.watched) + SWEEP_EVERY
            return unsure
        finally:
            lock.release()

    def wait(self, give_up: float) -> list[Acked]:
        """Until every watched put is answered (at most ``ANSWER_S``, and not past the
        monotonic ``give_up``); returns the puts to settle, the unanswered ones included."""
        give_up = min(give_up, time.monotonic() + ANSWER_S)
        pause, unsure = FIRST_PAUSE_S, []
        while True:
            with self._lock:
                unsure += self._sweep()
                if not self.watched:
                    return unsure
                if time.monotonic() + pause > give_up:  # no answer: settle decides
                    unsure += [item for item, _ in self.watched]
                    self.watched = []
                    return unsure
            time.sleep(pause)
            pause = min(2 * pause, LAST_PAUSE_S)

    def _sweep(self) -> list[Acked]:
        """(Under the lock.) Forget the puts their node made visible; return those
        it could not commit, or whose record no longer answers for them."""
        waiting, unsure = [], []
        for item, records in self.watched:
            state = records.outcome(item.offset, item.alloc_id)
            if state == NODE_COMMITS:
                waiting.append((item, records))
            elif state != VISIBLE:  # NOT_COMMITTED, or the record was reused: look it up
                unsure.append(item)
        self.watched = waiting
        return unsure
