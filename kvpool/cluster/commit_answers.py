"""The node's answers to TCP writers that asked it to commit their blocks.

A TCP put may ask its node to send the block's master commit (tcp_wire
``WRITE_COMMIT``: the writer then sends no commit frame and reads no reply;
issue 17). The node's commit thread (kvpool.cluster.node_commits) commits it
with others in one call, and its writer learns how that went by asking
(``COMMITS``: its flush, which waits for the answer, and its janitor now and
then, which does not). ``CommitAnswers`` is
the book in between, keyed by (allocation id, block offset), the way a
same-host writer's seal record names its block:

- ``NODE_COMMITS`` (kvpool.transport.shm_seal) while the commit is owed;
- ``VISIBLE``: committed, or the key was stored already, or the block was
  re-registered with a newer master;
- ``NOT_COMMITTED``: the master knew no such grant (it expired), or the block
  was no longer whole under that allocation when owed;
- ``UNKNOWN`` (tcp_wire): no such ask here, or its answer was forgotten.

Every state but ``VISIBLE`` leaves the put to its writer to settle
(kvpool.cluster.client.commits: commit it itself, look the key up, read back
and put again), so a forgotten answer costs time, never a block.

Invariants (thread-safe: data-server threads and the commit thread):
- an ask is ``owed`` before its write is acknowledged (and before the commit
  thread can take it), so an asker after the acknowledgement never reads
  ``UNKNOWN`` for a commit still to come, nor an older write's answer;
- an answer is handed out once (asking forgets it); an answer or ask not
  asked about within ``keep_s`` is forgotten, and at most ``max_kept`` are
  kept (the oldest go first): a writer that died never makes the book grow.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvpool.transport.shm_seal import NODE_COMMITS
from kvpool.transport.tcp_wire import UNKNOWN

KEEP_S = 30.0  # an answer nobody asked for this long is forgotten (writers ask within 2 s)
MAX_KEPT = 1 << 17  # answers and asks kept at most
MAX_WAIT_S = 1.0  # an ask waits this long at most for a commit still owed
_GONE = (UNKNOWN, 0.0, 0)  # the book's entry for an id it does not hold


def _no_op() -> None:
    pass


class CommitAnswers:
    """The commits TCP writers asked this node for, and how each went."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        keep_s: float = KEEP_S,
        max_kept: int = MAX_KEPT,
    ) -> None:
        self._clock, self._keep_s, self._max_kept = clock, keep_s, max_kept
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # an answer was recorded
        # (allocation id, block offset) -> (state, when it was set, master term), oldest first
        self._book: OrderedDict[tuple[int, int], tuple[int, float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._book)

    def owed(self, alloc_id: int, offset: int, epoch: int) -> None:
        """A writer asked for the commit of this block, allocation ``alloc_id`` of master
        term ``epoch``. What is still kept under the same id is an older write's
        (allocation ids are unique only within a term): replaced, so this writer never
        reads another's answer."""
        key = (alloc_id, offset)
        with self._lock:
            now = self._clock()
            self._book[key] = (NODE_COMMITS, now, epoch)
            self._book.move_to_end(key)
            self._forget_old(now)

    def answer(self, alloc_id: int, offset: int, epoch: int, state: int) -> bool:
        """The commit thread's answer for that write; False (nothing kept) if no TCP
        writer asked here. An older term's answer never lands on a newer write's ask."""
        key = (alloc_id, offset)
        with self._lock:
            got = self._book.get(key)
            if got is None:
                return False
            if got[2] != epoch:
                return True  # a newer write of the same id asked since: not its answer
            now = self._clock()
            self._book[key] = (state, now, epoch)
            self._book.move_to_end(key)
            self._forget_old(now)
            self._answered.notify_all()
            return True

    def ask(
        self, ids: list[tuple[int, int]], wait_s: float = 0.0, hurry: Callable[[], None] = _no_op
    ) -> bytes:
        """One state byte per (allocation id, block offset), each answer handed out
        once. While one of them is still owed, ``hurry`` the commit thread (once) and
        wait up to ``wait_s`` (at most ``MAX_WAIT_S``) for its answer."""
        book, n = self._book, len(ids)
        with self._answered:
            deadline = self._clock() + min(wait_s, MAX_WAIT_S)
            hurried, at = False, 0  # ids[:at] were answered when looked at: O(n) checks in all
            while True:
                while at < n and book.get(ids[at], _GONE)[0] != NODE_COMMITS:
                    at += 1
                left = deadline - self._clock()
                if at == n or left <= 0:
                    break
                if not hurried:
                    hurry()
                    hurried = True
                self._answered.wait(left)
            out = bytearray(len(ids))
            for i, key in enumerate(ids):
                state = book.get(key, _GONE)[0]
                out[i] = state
                if state != NODE_COMMITS and state != UNKNOWN:
                    del book[key]
        return bytes(out)

    def _forget_old(self, now: float) -> None:
        """(Under the lock.) Drop what nobody asked for within ``keep_s``, and the
        oldest past ``max_kept``."""
        book, cutoff = self._book, now - self._keep_s
        while book and (len(book) > self._max_kept or next(iter(book.values()))[1] < cutoff):
            book.popitem(last=False)
