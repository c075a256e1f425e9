"""Nodes this client saw fail, kept out of its placements until the master catches up.

Why: the master learns that a node died only when its heartbeats have been
missing for the node TTL (``--node-ttl``, 5 s by default). Until then it keeps
placing puts there, and the dead node is the one it favours: its free space no
longer shrinks while every other node's does. With two nodes alive beside a
dead one, a put asking for two replicas got the dead node and one other, lost
the dead node's write and was acknowledged with one copy: in a storm that
killed a node every 4 s (tests/test_node_storm.py) 184 of 695 such puts had one
copy, and the next kill lost 119 of them.

So a client names the nodes it saw fail (a put's or a reservation's write)
in every allocation it asks for (``AllocateRequest.avoid``: puts, grant
refills, reservations): the master places a block there only when no other
node can take it, and grants nothing there. A suspicion ends
``SUSPECT_S`` after the last failure this client saw on that node: by then
the master has dropped a dead node, and a live one that failed once (a
connection reset) takes blocks again.

Reads: a read tries a copy on a suspected node last, and while a node is
suspected one read a second (``RETRY_S``) tries it at all (``may_read``); the
others skip it, so a block whose only copy is there is a miss at once instead
of a wait: a dead host's connect or an answer that never comes costs the
whole transport timeout (seconds), and every read of that node's blocks paid
it until the master dropped the node. A read that succeeds there clears the
suspicion (``cleared``): the node serves again; so does a new region for it
from the master (``ClientSession.learn``: it restarted, what failed was the
old incarnation).

Invariants: a node is named for at most ``SUSPECT_S`` after the last failure
reported here; a suspected node gets at most one read try per ``RETRY_S`` (a
read's failure counts as one; a write's does not: the next read tries).
Thread-safe (writes and reads report from any thread, allocations and reads ask).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: How long a node stays avoided after a failure: the master's default node TTL.
SUSPECT_S = 5.0
#: A suspected node is tried by one read this often; the others skip it.
RETRY_S = 1.0


class Suspects:
    """node id -> when this client last saw it fail (``clock`` seconds)."""

    def __init__(
        self,
        hold_s: float = SUSPECT_S,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = RETRY_S,
    ) -> None:
        self.hold_s, self.retry_s, self._clock = hold_s, retry_s, clock
        self._since: dict[str, float] = {}
        self._tried: dict[str, float] = {}  # suspected node -> its last read try
        self._lock = threading.Lock()

    def report(self, node_id: str, by_read: bool = False) -> None:
        """A transfer to ``node_id`` failed (its connection broke or was refused);
        ``by_read``: a read's, which counts as the node's read try."""
        with self._lock:
            self._since[node_id] = now = self._clock()
            if by_read:
                self._tried[node_id] = now

    def may_read(self, node_id: str) -> bool:
        """Whether a read may try ``node_id`` now: yes unless it is suspected and
        another try went there less than ``retry_s`` ago (a yes for a suspected
        node is that try: the caller reports its failure or ``cleared``)."""
        if not self._since:  # the common case: no failure seen, no lock taken
            return True
        now = self._clock()
        with self._lock:
            since = self._since.get(node_id)
            if since is None or now - since >= self.hold_s:
                return True
            tried = self._tried.get(node_id)
            if tried is not None and now - tried < self.retry_s:
                return False
            self._tried[node_id] = now
            return True

    def cleared(self, node_id: str) -> None:
        """A transfer to ``node_id`` succeeded: it is not suspected any more."""
        if node_id in self._since:  # (racy on purpose: a miss clears on the next read)
            with self._lock:
                self._since.pop(node_id, None)
                self._tried.pop(node_id, None)

    def current(self) -> list[str]:
        """The nodes to avoid now; forgets those whose suspicion ended."""
        if not self._since:  # the common case: no failure seen, no lock taken
            return []
        now = self._clock()
        with self._lock:
            for node_id in [n for n, t in self._since.items() if now - t >= self.hold_s]:
                del self._since[node_id]
                self._tried.pop(node_id, None)
            return sorted(self._since)
