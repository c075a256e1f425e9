"""The writer's side of commits sent by the node: puts acknowledged, committed by their node.

A put whose node sends its master commit sends nothing to the master: a
same-host put whose seal record asks its node for it (kvpool.transport.shm_seal
``NODE_COMMITS``), or a TCP put whose final write does (tcp_wire
``WRITE_COMMIT``); the node's side is kvpool.cluster.node_commits. The writer
still owes read-your-writes, so it keeps such puts here until their node
answers: in the seal record (``watch``), or when asked over the data
connection (``ask``: tcp_wire ``COMMITS``). ``VISIBLE`` (committed, or the key
was stored already) ends the watch; ``NOT_COMMITTED``, a record reused for a
later claim before it was read, an answer the node no longer has, a node that
cannot be asked, or no answer within ``ANSWER_S`` (a healthy node answers
within milliseconds: its node died, or its commit thread is stuck) hands the
put to ``CommitPipe.settle`` (retry, look the key up, read back and put again).
A flush that has waited ``PROBE_S`` asks whether the nodes still owing answers
are alive (``alive``: a connect to the node's data port) and hands out the puts
of a dead one at once: a seal record of a dead node never changes, and waiting
``ANSWER_S`` for it stalled every read of the writer after a node died.
A put settled so while its node still commits it is committed twice at worst:
the second commit finds no grant and the key already stored.

Invariants:
- every watched put is either still waiting (its node owes the commit), or
  forgotten because it is visible, or handed out to settle exactly once;
- seal records are swept every ``SWEEP_EVERY`` new puts, on the putting thread
  (no I/O); TCP puts by ``sweep_asked`` (the client's janitor, each tick: one
  round trip per node) and by ``wait``. So a client that only writes keeps at
  most the puts its nodes have not answered yet, plus a tick's worth.

Bound for other clients: at once after the put's ring or owed write wakes the
node's commit thread, or its poll period while it polls (``node_commits.IDLE_S``,
2 ms; 0.25 ms while same-host puts stream), plus one master round trip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvpool.cluster.client.acked import Acked
from kvpool.errors import KVPoolError
from kvpool.transport.shm_seal import NODE_COMMITS, NOT_COMMITTED, VISIBLE, SealRecords
from kvpool.transport.tcp import TcpTransport

SWEEP_EVERY = 64  # watched puts between sweeps of the answers
ANSWER_S = 2.0  # a flush waits this long for its node's answers, then settles the rest
FIRST_PAUSE_S, LAST_PAUSE_S = 0.00005, 0.002  # a waiting flush polls seal records so
ASK_WAIT_S = 0.5  # a waiting flush's ask: the node answers once its commits are done
PROBE_S = 0.05  # a flush waiting this long asks whether the nodes owing answers are alive


class NodeWatch:
    """The puts of one client whose node sends their commit (thread-safe)."""

    def __init__(self) -> None:
        # alive(node id): does the node still run? Set by the client (a connect probe:
        # ClientSession.node_alive); None: a flush never asks, it waits ANSWER_S.
        self.alive: Callable[[str], bool] | None = None
        self._lock = threading.Lock()
        self._asking = threading.Lock()  # one ``sweep_asked`` at a time
        self.watched: list[tuple[Acked, SealRecords]] = []  # answered in seal records
        self.asked: list[tuple[Acked, TcpTransport]] = []  # answered when asked (TCP)
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

    def ask(self, item: Acked, node: TcpTransport) -> None:
        """Watch ``item``, written over ``node`` with ``WRITE_COMMIT``: answered when asked."""
        with self._lock:
            self.asked.append((item, node))
            self.count += 1

    def busy(self) -> bool:
        """Some put still waits for its node's answer (no lock: a hint, as reads go)."""
        return bool(self.watched or self.asked)

    def wait(self, give_up: float) -> list[Acked]:
        """Until every watched put is answered (at most ``ANSWER_S``, and not past the
        monotonic ``give_up``); returns the puts to settle, the unanswered ones included."""
        probe_at = time.monotonic() + PROBE_S
        give_up = min(give_up, time.monotonic() + ANSWER_S)
        pause, unsure = FIRST_PAUSE_S, []
        while True:
            unsure += self.sweep_asked(max(0.0, min(ASK_WAIT_S, give_up - time.monotonic())))
            with self._lock:
                unsure += self._sweep()
                if not (self.watched or self.asked):
                    return unsure
                if time.monotonic() + pause > give_up:  # no answer: settle decides
                    unsure += [item for item, _ in self.watched]
                    unsure += [item for item, _ in self.asked]
                    self.watched, self.asked = [], []
                    return unsure
                owing = {item.node_id for item, _ in self.watched}
            alive = self.alive
            if owing and alive is not None and time.monotonic() >= probe_at:
                probe_at = give_up  # once per wait
                unsure += self._of_dead_nodes({n for n in owing if not alive(n)})
            time.sleep(pause)
            pause = min(2 * pause, LAST_PAUSE_S)

    def _of_dead_nodes(self, dead: set[str]) -> list[Acked]:
        """Stop watching the seal records of ``dead`` nodes: their puts, to settle."""
        if not dead:
            return []
        with self._lock:
            gone = [item for item, _ in self.watched if item.node_id in dead]
            self.watched = [(i, r) for i, r in self.watched if i.node_id not in dead]
        return gone

    def sweep_asked(self, wait_s: float = 0.0) -> list[Acked]:
        """Ask each node about its TCP puts watched now (one round trip per node, which
        may wait ``wait_s`` for commits still owed); forget those visible, return those
        to settle (not committed, unknown there, or the node could not be asked). The
        puts stay watched while their node is asked (a flush's lock-free ``busy`` must
        see them); sweeps run one at a time."""
        with self._asking:
            with self._lock:
                taken = list(self.asked)
            by_node: dict[int, tuple[TcpTransport, list[Acked]]] = {}
            for item, node in taken:
                by_node.setdefault(id(node), (node, []))[1].append(item)
            done: set[int] = set()  # id() of the puts answered (Acked compare by value)
            unsure: list[Acked] = []
            for node, items in by_node.values():
                try:
                    states = node.commit_outcomes([(a.alloc_id, a.offset) for a in items], wait_s)
                except (KVPoolError, OSError):  # the node is gone or unreachable: settle decides
                    states = [NOT_COMMITTED] * len(items)
                for item, state in zip(items, states, strict=True):
                    if state != NODE_COMMITS:
                        done.add(id(item))
                        if state != VISIBLE:
                            unsure.append(item)
            if not done:
                return []
            with self._lock:  # a flush that gave up meanwhile handed the rest out already
                still = {id(a) for a, _ in self.asked}
                self.asked = [(a, n) for a, n in self.asked if id(a) not in done]
            return [a for a in unsure if id(a) in still]

    def _sweep(self) -> list[Acked]:
        """(Under the lock.) Forget the puts their node made visible in their seal
        records; return those it could not commit, or whose record no longer
        answers for them."""
        waiting, unsure = [], []
        for item, records in self.watched:
            state = records.outcome(item.offset, item.alloc_id)
            if state == NODE_COMMITS:
                waiting.append((item, records))
            elif state != VISIBLE:  # NOT_COMMITTED, or the record was reused: look it up
                unsure.append(item)
        self.watched = waiting
        return unsure
