"""A client's transports to the nodes on its host, made before its first call needs them.

Why: a same-host transport maps the node's whole arena and fills this process's
page tables for it (kvpool.transport.shm: ~70 ms per GiB on the 2 vCPU VM of
issue 17), and a fenced write's side channel opens a TCP connection to the node.
The first put or get to each node paid for both: a first ``get_into`` beside a
2 GiB node took ~115 ms, the next ones ~0.4 ms. Right after ``connect`` a
background thread asks the master for every node's region (``REGIONS``) and
makes these for the nodes on this host, so an engine that connects and then
loads its model finds them ready. A call that needs a transport still being
made waits for that build (``PeerTransports`` builds each once), never starts
a second one; a call that comes first simply builds it itself, as before.

Best effort: a master that does not answer ``REGIONS`` (an older release, a
failover under way) or a node that cannot be mapped is left to the first call,
which raises its errors as it always did. Nodes on other hosts are not warmed:
their TCP connect costs a round trip, and a client of a large cluster should not
open a connection to every node it may never use.

Invariant: ``close()`` returns only once the thread ended (it waits for the build
under way at most ``timeout``); the session refuses new transports once closed,
so none is made after it.
"""

from __future__ import annotations

import logging
import threading

from kvpool.cluster.client.session import ClientSession
from kvpool.cluster.wire import REGIONS
from kvpool.transport.base import RegionInfo
from kvpool.transport.shm import shm_reachable

log = logging.getLogger("kvpool.cluster.client")


class TransportWarmUp:
    """Warms ``session``'s same-host transports in a daemon thread, started at once."""

    def __init__(self, session: ClientSession) -> None:
        self.nodes = 0  # same-host nodes whose transports were made here
        self._session = session
        self._thread = threading.Thread(target=self._run, name="kvpool-warm-up", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        session = self._session
        try:
            answer = session.rpc.call(REGIONS)
            regions = {n: RegionInfo.from_dict(d) for n, d in answer.items()}
            # Only nodes no reply named yet: a put's newer region must not be undone.
            session.learn({n: r for n, r in regions.items() if n not in session.regions})
            for node_id, region in regions.items():
                if session.closed:
                    return
                if shm_reachable(region):
                    self._warm(node_id)
        except Exception as exc:  # best effort: the first call builds and reports
            log.debug("warm-up of node transports stopped: %s", exc)

    def _warm(self, node_id: str) -> None:
        session = self._session
        try:
            session.transport(node_id)  # maps the arena, fills its page tables
            session.control(node_id).connect_ahead()
            session.seals(node_id)
            self.nodes += 1
        except Exception as exc:
            if session.closed:
                raise
            log.debug("warm-up of node %s's transport failed: %s", node_id, exc)

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the thread to end (soon once the session closed)."""
        self._thread.join(timeout)
