"""Pipelined commits: a put is acknowledged when its node holds it, not when the master does.

A distributed put has two halves (kvpool.cluster.client.puts): the bytes land
on a node under the write fence, then the master's ``COMMIT`` makes the key
visible. The first half is what makes a put *durable*: once the node has the
block whole with its key (the TCP write carrying its stamp was acknowledged,
or the same-host copy was sealed), the node reports that block when it
(re-)registers, so it outlives a master crash at any instant. The second half
only makes it *visible*. ``CommitPipe`` takes that second round trip off the
put's critical path: the put sends its ``COMMIT`` on the master connection
(without waiting) and returns; the reply is handled when it arrives.

Rules (the README's "visibility rule"):
- read-your-writes: every read-side call of the writer (get*, exists,
  prefix_match, lease, locate, remove, replicate, stats) first ``flush``-es, i.e.
  waits for the answers of the commits it sent;
- other clients see a block once its commit reached the master: the
  commit is on the wire when ``put`` returns, so within one master round trip
  when healthy; across a master restart or failover, once the node holding it
  re-registered (or the retried commit landed);
- no acknowledged put is lost silently. A commit the master could not apply
  (its connection was lost; the grant or allocation is unknown: the master
  restarted, or expired it) is settled by ``settle``: retried on the current
  master, else looked up (a node that re-registered brought it back), else
  *recovered* -- the sealed bytes are read back from the node through the
  fence's checked read (served only while that block still holds the range)
  and put again the classic way. Only if that fails too does the put become
  an error: ``PutCommitError``, raised by the next call of the writer that
  flushes or puts, and by ``close`` -- unless its node cannot be reached: then
  its only copy died with the node, as a visible block's does (logged, counted);
- a grant is used at most ``grants.MAX_USE_S`` (1 s) after it was granted and
  its commit is sent at the ack, so in a healthy cluster a commit arrives long
  before the master could expire the grant (its TTL is at least twice that).

Sending (issue 17): the writer's thread does not send the COMMIT itself. It
records the put's items (in flight, or queued behind the one in flight) and
wakes the pipe's sender thread (single puts; a batch's commit is sent by the
caller at once, as before), which sends everything queued by then in one frame
``LINGER_S`` (1 ms) after the first of them was acknowledged; items queued
behind a COMMIT in flight also wait for its answer (then leave at once if their
linger is over). The encode (~20-30 us of Python), the loopback ``sendall``
(~30-60 us: the kernel runs the master's receive path inside it) and the
answer's decode were a third of a 1 MiB same-host put's time (py-spy,
2026-12-01); now they leave the put's path, and a stream of puts pays them
once per frame, about one per ``LINGER_S`` (not one per master round trip: on a
2 vCPU Intel VM a stream of TCP puts sent 0.42-0.58 frames per put so, 0.13-0.36
now; bench/RESULTS.md, session 24). A ``flush`` (every read-side call of the
writer, ``close``) cuts the linger short, so read-your-writes costs no extra
wait. Bound for other clients: the commit leaves within ``LINGER_S`` of the
put's return, or when the commit in flight is answered if that is later, plus,
if the writer's thread keeps the GIL in pure Python, the interpreter's switch
interval (5 ms); the block is visible one master round trip later.
``$KVPOOL_PUT_COMMIT_THREAD=0`` sends on the writer's thread at once instead
(what puts did before; kept and tested).

Commits by the node (issue 17): a single put sealed in shared memory, or
written over TCP with ``WRITE_COMMIT``, may leave its commit to its node
(kvpool.cluster.node_commits) and send nothing to the master; ``watch``
records it (kvpool.cluster.client.node_watch), ``flush`` waits for the
node's answer too (``settle`` asks TCP nodes for theirs each janitor tick), and
what the node could not commit is settled here like a refused commit.
``$KVPOOL_NODE_COMMITS=0`` keeps commits with the client.

Thread-safety: one condition guards the bookkeeping; replies are handled on the
RPC reader thread, which only records them and sends what was queued behind
them (no waiting there); retries and recoveries run in the caller of
``settle`` (a writer's call, or the client's janitor thread).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from kvpool.cluster.client.acked import Acked, Recover, Recovery
from kvpool.cluster.client.node_watch import NodeWatch
from kvpool.cluster.client.put_modes import commit_thread_default
from kvpool.cluster.wire import COMMIT, EXISTS, CommitRequest, KeysRequest
from kvpool.errors import KVPoolError, PutCommitError
from kvpool.transport.shm_seal import SealRecords
from kvpool.transport.tcp import TcpTransport

log = logging.getLogger("kvpool.cluster.client")
LINGER_S = 0.001  # the sender thread waits this long for more puts to share a frame


class CommitPipe:
    """The commits of one client's acknowledged puts, on their way to the master."""

    def __init__(
        self, rpc: Any, recover: Recover, deadline_s: float, threaded: bool | None = None
    ) -> None:
        self._rpc, self._recover, self._deadline_s = rpc, recover, deadline_s
        self.threaded = commit_thread_default() if threaded is None else threaded
        self.linger_s = LINGER_S
        self._hurry = threading.Event()  # a flush waits: send without lingering
        # The sender thread's wake-ups: the in-flight batch set but not sent yet (by a put,
        # or by the answer it was queued behind) and the monotonic time its first item was
        # acknowledged; or None to stop. Started by the first send; stopped by close.
        self._wake: queue.SimpleQueue[tuple[list[Acked], float] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._inflight: list[Acked] | None = None  # the one COMMIT awaiting its answer
        self._queue: list[Acked] = []  # acknowledged while it was in flight: sent next
        self._queued_at = 0.0  # when the first item of ``_queue`` was acknowledged
        self._unsure: list[Acked] = []  # unanswered (lost link) or refused: to settle
        self._busy: list[Acked] = []  # being settled now (flush waits for them too)
        self._failed: list[tuple[list[bytes], str]] = []  # to raise on the next call
        self._withdrawn: set[int] = set()  # alloc ids of puts answered False after all
        self._open: set[int] = set()  # alloc ids whose put has not answered yet
        self.by_node = NodeWatch()  # puts whose node sends their commit
        self._settling = threading.Lock()
        self.sent = self.duplicates = self.recovered = 0

    # -- the put's side -----------------------------------------------------------------

    def send(self, items: list[Acked]) -> None:
        """Commit ``items`` without waiting: sent now when no commit is in flight,
        else coalesced into the one sent when the in-flight one is answered (so a
        stream of puts costs one master round trip per answer, not per put)."""
        if not items:
            return
        with self._cond:
            self._open.update(a.alloc_id for a in items)
            if self._inflight is not None:
                if not self._queue:
                    self._queued_at = time.monotonic()
                self._queue += items
                return
            self._inflight = items
            # A batch's commit already carries several blocks: it goes at once from
            # the caller (in interleaved runs under load, batches handed to the thread
            # measured slower: put_batch 1 MiB tcp 1.69 -> 1.15x, shm 16 MiB 0.74 -> 0.51x).
            if self.threaded and not self._stopped and len(items) == 1:
                if self._sender is None:
                    self._sender = threading.Thread(
                        target=self._send_loop, name="kvpool-commits", daemon=True
                    )
                    self._sender.start()
                self._wake.put((items, time.monotonic()))
                return
        self._submit(items)

    def watch(self, item: Acked, node: SealRecords | TcpTransport) -> None:
        """A put its node commits: sealed with ``NODE_COMMITS`` in ``node``'s seal
        records, or written with ``WRITE_COMMIT`` over TCP transport ``node``.
        ``flush`` waits for the node's answer (``settle`` asks TCP nodes for theirs)."""
        if isinstance(node, TcpTransport):
            self.by_node.ask(item, node)
            return
        unsure = self.by_node.watch(item, node)
        if unsure:
            self._to_settle(unsure)

    def _to_settle(self, items: list[Acked]) -> None:
        """Puts their node did not make visible: ``settle`` takes them next."""
        if items:
            with self._cond:
                self._unsure += items

    def _send_loop(self) -> None:
        """The sender thread: submit each batch set in flight (not sent yet), once
        ``linger_s`` passed since its first item was acknowledged, with what was
        queued behind it by then (not sent yet either: nothing answered it)."""
        while (wake := self._wake.get()) is not None:
            token, since = wake
            linger = since + self.linger_s - time.monotonic()
            if linger > 0:
                self._hurry.wait(linger)  # more puts join this frame meanwhile
                self._hurry.clear()
            with self._cond:
                if self._inflight is not token:  # flush gave up on it: settle owns it
                    continue
                batch = token + self._queue if self._queue else token
                self._inflight, self._queue = batch, []
            try:
                self._submit(batch)
            except Exception as exc:  # never lose the thread: settle retries them
                log.warning("commit not sent (%s); it is retried", exc)
                with self._cond:
                    if self._inflight is batch:
                        self._unsure += batch + self._queue
                        self._inflight, self._queue = None, []
                    self._cond.notify_all()

    def _submit(self, items: list[Acked]) -> None:
        """Send the in-flight batch ``items`` (``_inflight`` is set to it)."""
        request = CommitRequest([a.alloc_id for a in items])
        if any(a.granted for a in items):
            request.keys = [a.key if a.granted else None for a in items]
            request.parents = [a.parent if a.granted else None for a in items]
        try:
            fut: Future[Any] = self._rpc.submit(COMMIT, request)
        except (KVPoolError, OSError) as exc:  # no master connected now: settle retries
            log.debug("commit not sent (%s); it is retried", exc)
            with self._cond:  # unsure first: flush's lock-free check never sees a gap
                self._unsure += items + self._queue
                self._inflight, self._queue = None, []
                self._cond.notify_all()
            return
        self.sent += 1
        fut.add_done_callback(lambda f: self._answered(items, f))

    def answered(self, items: list[Acked], refused: list[int]) -> None:
        """The put that sent ``items`` answered; ``refused``: the alloc ids it
        answered False for after all (their node refused the seal that the commit
        overlapped), so a refused commit of theirs is no error. Until this call,
        ``settle`` leaves the put's items alone."""
        with self._cond:
            self._open.difference_update(a.alloc_id for a in items)
            self._withdrawn.update(refused)

    def check(self) -> None:
        """Raise ``PutCommitError`` for puts already known lost (no waiting)."""
        if not self._failed:  # every put checks: no lock unless something failed
            return
        with self._cond:
            failed, self._failed = self._failed, []
        if failed:
            keys = [k for ks, _ in failed for k in ks]
            raise PutCommitError(keys, "; ".join(sorted({why for _, why in failed})))

    def idle(self) -> bool:
        """Nothing in flight, queued or to settle."""
        with self._cond:
            return self._inflight is None and not (
                self._queue or self._unsure or self._busy or self.by_node.busy()
            )

    def flush(self) -> None:
        """Wait until every commit of a put acknowledged so far is answered and
        every refused one settled (bounded by the failover deadline), then raise
        ``PutCommitError`` for what was lost."""
        # Fast path of every read (no lock): this thread's own puts set these
        # before they returned, so a read after them never misses its own writes.
        if self._inflight is None and not (
            self._queue or self._unsure or self._busy or self._failed or self.by_node.busy()
        ):
            return
        if self.idle():
            self.check()
            return
        self._hurry.set()  # the sender thread stops lingering
        give_up = time.monotonic() + self._deadline_s + 1.0
        with self._cond:
            while self._inflight is not None or self._queue:
                left = give_up - time.monotonic()
                if left <= 0:  # never answered: settle retries them on the current master
                    self._unsure += (self._inflight or []) + self._queue
                    self._inflight, self._queue = None, []
                    break
                self._cond.wait(min(left, 0.5))
        self._to_settle(self.by_node.wait(give_up))
        self.settle()
        self.check()

    def settle(self) -> None:
        """Retry, look up or recover the commits that were not applied (blocking:
        master calls, reads from nodes). Runs in a writer's call or the janitor."""
        self._to_settle(self.by_node.sweep_asked())  # TCP puts their node commits
        with self._settling:
            with self._cond:
                items = [
                    a
                    for a in self._unsure
                    if a.alloc_id not in self._withdrawn and a.alloc_id not in self._open
                ]
                self._busy = items
                self._unsure = [a for a in self._unsure if a.alloc_id in self._open]
                if self._inflight is None and not self._queue and not self._unsure:
                    self._withdrawn.clear()  # nothing sent can name them any more
            try:
                if items:
                    self._settle(items)
            finally:
                self._busy = []

    def close(self) -> None:
        """Flush (``close`` of the pool): every acknowledged put visible, or raised;
        then stop the sender thread (a later send goes on the caller's thread)."""
        try:
            self.flush()
        finally:
            with self._cond:
                self._stopped = True
                sender, self._sender = self._sender, None
            if sender is not None:
                self._wake.put(None)
                sender.join(timeout=5.0)

    # -- replies and settling -------------------------------------------------------------

    def _answered(self, items: list[Acked], fut: Future[Any]) -> None:
        """On the RPC reader thread: record the answers (cheap), then set what was
        queued meanwhile in flight: the sender thread sends it ``linger_s`` after its
        first item was acknowledged, or this thread at once if that has passed (or
        there is no sender thread): one small frame on a connection that just answered."""
        with self._cond:
            if self._inflight is not items:  # flush gave up on it: settle owns it now
                return
            try:
                done = list(fut.result(timeout=0))
            except Exception as exc:  # lost connection, failover: settle retries
                log.debug("commit unanswered (%s); it is retried", exc)
                self._unsure += items + self._queue
                self._inflight, self._queue = None, []
                self._cond.notify_all()
                return
            for item, ok in zip(items, done, strict=False):
                if ok:
                    continue
                if ok is False and item.granted:
                    self.duplicates += 1  # the key was stored already: the first block stays
                else:  # unknown grant (None), or an allocation the master no longer has
                    self._unsure.append(item)
            following, self._queue = self._queue, []
            self._inflight = following or None
            self._cond.notify_all()
            threaded = self._sender is not None and not self._stopped
            linger = threaded and time.monotonic() < self._queued_at + self.linger_s
            if following and linger:  # before close's stop token, under the lock
                self._wake.put((following, self._queued_at))
        if following and not linger:
            self._submit(following)

    def _settle(self, items: list[Acked]) -> None:
        # 1. Retry the commit itself on whichever master leads now (MasterLink rides
        #    through a failover); a new master answers None/False: it never lent it.
        try:
            done = self._call_commit(items)
        except KVPoolError as exc:
            self._lost(items, f"no master took the commit: {exc}")
            return
        rest = [
            a
            for a, ok in zip(items, done, strict=True)
            if not ok and not (ok is False and a.granted)
        ]
        self.duplicates += sum(
            1 for a, ok in zip(items, done, strict=True) if ok is False and a.granted
        )
        if not rest:
            return
        # 2. After a master restart, the node holding the block re-registers it;
        # 3. else read the sealed bytes back from the node and put them again. While
        #    the cluster is still recovering (bytes in hand, not visible yet: nodes
        #    re-registering), try again, until the failover deadline.
        give_up, pause = time.monotonic() + self._deadline_s, 0.05
        while True:
            try:
                found = list(self._rpc.call(EXISTS, KeysRequest([a.key for a in rest])))
                rest = [a for a, hit in zip(rest, found, strict=True) if not hit]
                if not rest:
                    return
                outcome = self._recover(rest)
            except KVPoolError as exc:
                self._lost(rest, f"recovery failed: {exc}")
                return
            self.recovered += outcome.count(Recovery.VISIBLE)
            gone = [a for a, v in zip(rest, outcome, strict=True) if v is Recovery.GONE]
            if gone:
                self._lost(
                    gone, "the master refused the commit and the node no longer holds the bytes"
                )
            self._lost_with_node(
                [a for a, v in zip(rest, outcome, strict=True) if v is Recovery.NODE_LOST]
            )
            rest = [a for a, v in zip(rest, outcome, strict=True) if v is Recovery.PENDING]
            if not rest:
                return
            if time.monotonic() + pause > give_up:
                self._lost(rest, f"not visible within {self._deadline_s:g} s of recovering")
                return
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def _call_commit(self, items: list[Acked]) -> list[bool | None]:
        request = CommitRequest([a.alloc_id for a in items])
        if any(a.granted for a in items):
            request.keys = [a.key if a.granted else None for a in items]
            request.parents = [a.parent if a.granted else None for a in items]
        return list(self._rpc.call(COMMIT, request))

    def _lost_with_node(self, items: list[Acked]) -> None:
        """Puts whose node died before making them visible: their only copy went with
        it, as a visible block's does. Counted and logged, not raised."""
        if items:  # (counted in stats()["client"]["put_lost_with_node"]: recover_puts)
            nodes = ", ".join(sorted({a.node_id for a in items}))
            log.warning("%d acknowledged put(s) lost with their node (%s)", len(items), nodes)

    def _lost(self, items: list[Acked], why: str) -> None:
        log.error("%d acknowledged put(s) lost: %s", len(items), why)
        with self._cond:
            self._failed.append(([a.key for a in items], why))
