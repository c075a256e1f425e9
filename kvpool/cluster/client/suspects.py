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

Invariant: a node is named for at most ``SUSPECT_S`` after the last failure
reported here; thread-safe (writes report from any thread, allocations read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: How long a node stays avoided after a failure: the master's default node TTL.
SUSPECT_S = 5.0


class Suspects:
    """node id -> when this client last saw it fail (``clock`` seconds)."""

    def __init__(
        self, hold_s: float = SUSPECT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.hold_s, self._clock = hold_s, clock
        self._since: dict[str, float] = {}
        self._lock = threading.Lock()

    def report(self, node_id: str) -> None:
        """A transfer to ``node_id`` failed (its connection broke or was refused)."""
        with self._lock:
            self._since[node_id] = self._clock()

    def current(self) -> list[str]:
        """The nodes to avoid now; forgets those whose suspicion ended."""
        if not self._since:  # the common case: no failure seen, no lock taken
            return []
        now = self._clock()
        with self._lock:
            for node_id in [n for n, t in self._since.items() if now - t >= self.hold_s]:
                del self._since[node_id]
            return sorted(self._since)
