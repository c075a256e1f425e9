"""The node commits puts for their writers: the master ``COMMIT`` of blocks it holds whole.

A same-host writer that seals a claim taken ahead with ``NODE_COMMITS`` in its
seal record (kvpool.transport.shm_seal), or a TCP writer whose final write is a
``WRITE_COMMIT`` (kvpool.transport.tcp_wire), leaves the block's master commit
to the node holding it: the put itself sends nothing to the master (no COMMIT
frame, no reply to receive on the writer's CPU; issue 17), and the node's
frames carry the blocks of all its writers. ``SealCommitter`` is the node's
thread that does it:

1. poll the seal file's doorbell every ``FAST_S`` while writers rang within the
   last ``BUSY_S``, else every ``IDLE_S``; a ring, an ask about a commit still
   owed (``outcomes``), or ``IDLE_S`` passing adopts the records sealed for
   claims taken ahead and takes the blocks the table owes
   (``BlockTable.adopt_owed``; TCP writes are owed by their data server: ``owe``).
   Once ``QUIET_S`` passed without a block owed, and no commit is owed or to
   retry, it stops polling (``DOZE_S``, or ``ORPHAN_SCAN_S`` while it looks for
   orphans) until the table wakes it as a commit is owed
   (``BlockTable.seal_work``) or a writer rings: it sleeps on the doorbell as a
   futex (kvpool.transport.shm_doorbell), so claims taken ahead may stay open --
   a same-host client's stock of grants, for as long as it runs -- without a
   poll. An idle node woke 500 times a second, ~2.4% of a CPU here, for nothing
   (issue 17, session 26), and still did with a same-host client attached (~3%,
   session 48). Where the doorbell cannot wake it (``SealRecords.rings_wake``
   False: no compiled module, or a writer without one attached) open claims
   keep it polling every ``IDLE_S``, and the table wakes it as a claim is
   taken ahead. The quiet period keeps a stream of TCP puts (no claims taken
   ahead) sharing frames per poll, rather than waking the thread, and sending a
   frame, per put;
2. commit the blocks the table owes in one ``COMMIT`` (grant ids, keys,
   parents) on the node's own master connection, one call at a time, so a
   stream of puts shares frames;
3. answer each writer: in its seal record, or in the book TCP writers ask
   (kvpool.cluster.commit_answers). ``VISIBLE`` when the master committed
   it, or answered False (the key was stored already: the put's bytes were not
   needed), or the block was re-registered with a newer master; else
   ``NOT_COMMITTED`` (the master knew no such grant in the term that lent it:
   it expired). The writer settles that as a refused pipelined commit
   (kvpool.cluster.client.commits: look-up, read-back, put again).

It also commits, on their writers' behalf, blocks still unconfirmed ``orphan_age``
seconds after their seal (kvpool.cluster.unconfirmed): a writer killed by a
signal between its put's return and its commit leaves such a block, whole on the
node with its key; committing it now does what the next re-registration would.
The master answers True (committed), False (the key was stored meanwhile) or None
(no such allocation any more: committed or revoked by its writer, or expired):
nothing more is owed either way. ``orphan_age`` must exceed the node's heartbeat
interval (commit events arrive with heartbeats), and stay under the master's grant
TTL (5 s) less a grant's use window (1 s), or the grant is gone by then.

A master that cannot be reached is retried (each call rides a failover up to
the link's deadline, then the thread backs off from 50 ms to 1 s); a block from
an older term is answered by its state once the node serves a new term
(re-registered: ``VISIBLE``; dropped by the re-registration's checksum:
``NOT_COMMITTED``). Nothing is lost meanwhile: the block is whole on the node
with its key, and every registration reports it.

Bound (the README's visibility rule): a healthy node commits a sealed block
within one poll period (at most ``IDLE_S``; a ring wakes a sleeping thread at
once) plus the commit's round trip, after the one in flight; sooner when its
writer asks for the answer (a flush). A writer without the compiled module
attached after the thread went to sleep: its first ring is seen within
``DOZE_S``, then the thread polls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpool.cluster.block_entry import COMMITTED, Entry
from kvpool.cluster.block_table import BlockTable
from kvpool.cluster.commit_answers import CommitAnswers
from kvpool.cluster.link import MasterLink
from kvpool.cluster.wire import COMMIT, CommitRequest
from kvpool.errors import KVPoolError
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_doorbell import WRITER
from kvpool.transport.shm_seal import NOT_COMMITTED, VISIBLE, SealRecords

log = logging.getLogger("kvpool.cluster.node")
FAST_S = 0.00025  # doorbell poll while writers are busy
BUSY_S = 0.05  # "busy": a ring within this long
IDLE_S = 0.002  # doorbell poll (and record scan) otherwise
ORPHAN_SCAN_S = 0.25  # how often unconfirmed blocks are looked for
ORPHAN_MARGIN_S = 0.5  # a node's orphan age: its heartbeat interval plus this
QUIET_S = 0.5  # no block owed for this long: stop polling while nothing is open
DOZE_S = 1.0  # the longest wait with nothing to poll for (the table wakes it sooner)


class SealCommitter:
    """The node's thread that commits the blocks writers asked it to; the desk of its
    TCP data server for those asks (kvpool.transport.fencing.CommitDesk)."""

    def __init__(
        self,
        table: BlockTable,
        records: SealRecords,
        link: Callable[[], MasterLink],
        orphan_age: float | None = None,
    ) -> None:
        self._table, self._records, self._link = table, records, link
        self._orphan_age = orphan_age  # None: leave unconfirmed blocks alone
        self._stop = threading.Event()
        self._hurry = threading.Event()  # look now (``hurry``; the doorbell too)
        self.answers = CommitAnswers()  # of the TCP writers' asks
        self._thread = threading.Thread(target=self._loop, name="kvpool-node-commits", daemon=True)
        self._waiting: list[Entry] = []  # owed, not answered yet (master unreachable)
        self._orphans: list[Entry] = []  # unconfirmed, to commit for their writers
        self.committed = self.not_committed = 0  # blocks answered each way
        self.orphans_committed = 0  # blocks committed for writers that did not

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop polling. A commit call riding a master outage is not waited for past
        1 s: the thread is a daemon, and the node closes its link next."""
        self._stop.set()
        self.hurry()
        if self._thread.is_alive():
            self._thread.join(1.0)

    def _loop(self) -> None:
        rang_at = scanned_at = orphans_at = owed_at = 0.0
        pause, backoff = 0.0, 0.05  # after a failed commit: wait, doubling up to 1 s
        while not self._stop.is_set():
            now = time.monotonic()
            hurried = self._hurry.is_set()
            self._hurry.clear()
            bell = self._records.rung()
            if bell == WRITER:
                rang_at = now
            if hurried or bell or now - scanned_at >= IDLE_S:
                scanned_at = now
                owed = self._table.adopt_owed()
                if owed:
                    owed_at = now
                    self._waiting += owed
            if self._orphan_age is not None and now - orphans_at >= ORPHAN_SCAN_S:
                orphans_at = now
                self._orphans += self._table.unconfirmed(self._orphan_age)
            if (self._waiting or self._orphans) and now >= pause:
                try:
                    if self._waiting:
                        self._waiting = self._commit(self._waiting)
                    if self._orphans:
                        self._commit_orphans(self._orphans)
                        self._orphans = []
                    pause, backoff = 0.0, 0.05
                except Exception as exc:  # never lose the thread: its writers would wait on it
                    expected = isinstance(exc, KVPoolError | OSError)  # else a bug: its traceback
                    log.log(
                        logging.WARNING if expected else logging.ERROR,
                        "could not commit %d sealed block(s): %s",
                        len(self._waiting) + len(self._orphans),
                        exc,
                        exc_info=not expected,
                    )
                    pause, backoff = time.monotonic() + backoff, min(2 * backoff, 1.0)
            if now - rang_at < BUSY_S:
                self._hurry.wait(FAST_S)  # polled: a stream of puts shares frames
            elif self._waiting or self._orphans or now - owed_at < QUIET_S or not self._doze():
                self._hurry.wait(IDLE_S)

    def hurry(self) -> None:
        """Make the thread look now: an ask, a commit owed while it sleeps, ``close``."""
        self._hurry.set()
        self._records.hurry()  # where it sleeps on the doorbell

    def _doze(self) -> bool:
        """Wait (False at once: work is pending) until the table has work to poll for,
        a writer rings (where rings wake), an ask or ``close`` hurries, or the orphan
        scan is due."""
        table, records = self._table, self._records
        rings = records.rings_wake
        if table.seal_work(self.hurry, rings):  # set first: work from here on wakes
            table.seal_work(None)
            return False
        span = DOZE_S if self._orphan_age is None else ORPHAN_SCAN_S
        if rings:
            records.wait_ring(span)
        else:
            self._hurry.wait(span)
        table.seal_work(None)
        return True

    # -- the desk of the TCP data server (kvpool.transport.fencing.CommitDesk) ---------

    def owe(self, stamp: WriteStamp) -> None:
        """A TCP writer's final write asked for the commit (before its acknowledgement)."""
        s = stamp
        self.answers.owed(s.alloc_id, s.offset, s.epoch)  # first: the answer lands there
        if not self._table.owe(stamp):  # not whole under it now: its writer settles it
            self.answers.answer(s.alloc_id, s.offset, s.epoch, NOT_COMMITTED)
            self.not_committed += 1

    def outcomes(self, ids: list[tuple[int, int]], wait_s: float) -> bytes:
        """How those commits went; one still owed is committed now (its writer waits)."""
        return self.answers.ask(ids, wait_s, self.hurry)

    def _commit(self, owed: list[Entry]) -> list[Entry]:
        """Commit ``owed`` and answer their writers; returns those to retry."""
        epoch = self._table.epoch
        now_term = [e for e in owed if e.stamp.epoch == epoch]
        # entries hash by identity
        results = dict(zip(now_term, self._send(now_term), strict=True))
        retry = []
        registered = self._table.epoch != 0  # listed blocks are visible once registered
        for entry in owed:
            ok = results.get(entry)
            if ok is not None or (entry.state == COMMITTED and registered):
                self._answer(entry, VISIBLE)  # False: the key was stored already
            elif self._table.epoch in (0, entry.stamp.epoch) and entry not in results:
                retry.append(entry)  # re-registering, or its term's answer is still due
            elif self._table.epoch != epoch:
                retry.append(entry)  # a new term began during the call: ask it again
            else:  # no such grant in its term (expired), or not re-registered
                self._answer(entry, NOT_COMMITTED)
        return retry

    def _commit_orphans(self, orphans: list[Entry]) -> None:
        """Commit unconfirmed blocks of the term served now for their writers (those of
        an older term were listed at the re-registration, which made them visible)."""
        epoch = self._table.epoch
        done = self._send([e for e in orphans if e.stamp.epoch == epoch])
        self.orphans_committed += sum(1 for ok in done if ok)

    def _send(self, entries: list[Entry]) -> list[bool | None]:
        """One ``COMMIT`` of ``entries`` (grant or allocation ids, with their keys) on
        the node's master link; the master's answer per entry ([] for none)."""
        if not entries:
            return []
        stamps = [e.stamp for e in entries]
        request = CommitRequest(
            [s.alloc_id for s in stamps],
            keys=[s.key for s in stamps],
            parents=[s.parent for s in stamps],
        )
        return list(self._link().call(COMMIT, request))

    def _answer(self, entry: Entry, state: int) -> None:
        s = entry.stamp
        if not self.answers.answer(s.alloc_id, s.offset, s.epoch, state):  # not a TCP ask
            self._records.answer(s.offset, s.alloc_id, s.epoch, state)
        if state == VISIBLE:
            self.committed += 1
        else:
            self.not_committed += 1
