"""Claims taken ahead for stocked put grants: a same-host put skips a round trip.

A same-host (shared-memory) write must hold its node's claim on the range
while it copies (kvpool.cluster.client.fenced). For a grant the claim can be
taken before the put: when a refill of grants arrives, a background thread
claims the new ones on their nodes in one pipelined exchange per node, with
a placeholder key (the seal names the real key and parent). A put that takes
a claimed grant then costs the copy + one round trip (seal and master commit
in parallel). Over TCP nothing is claimed ahead: the stamp rides in the write.

Invariants: a claim is released when its grant is dropped unused (stale,
its node changed, the client closes) -- also when the grant was dropped while
its claim was on the way -- so a later allocation of the range is never kept
waiting (a leaked claim kept every later claim of the range ``BUSY``: puts
there failed after 2 s each); a claim's connection closing releases it on
the node. A claim taken ahead may be sealed in shared memory until its
deadline (kvpool.transport.shm_seal): the clock is read before it is sent.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor

from kvpool.cluster.client import fenced
from kvpool.cluster.client.grants import Grant, GrantStock
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession
from kvpool.errors import KVPoolError
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_seal import now_ns
from kvpool.transport.tcp import TcpTransport

log = logging.getLogger("kvpool.cluster.client")
NO_KEY = bytes(16)


def grant_stamp(grant: Grant, size: int) -> WriteStamp:
    return WriteStamp(grant.epoch, grant.alloc_id, grant.offset, size, NO_KEY)


class GrantClaims:
    def __init__(self, session: ClientSession, grants: GrantStock) -> None:
        self._session, self._grants = session, grants
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvpool-claims")

    def claim_soon(self) -> None:
        """Claim the unclaimed stocked grants on a background thread."""
        with contextlib.suppress(RuntimeError):  # shut down: the client is closing
            self._worker.submit(self._claim)

    def release(self, ids: list[int]) -> None:
        """Release the claims of grants dropped unused (best effort)."""
        self._release(self._grants.claims_of(ids))

    def _release(self, claims: list[tuple[Grant, int]]) -> None:
        by_node: dict[str, list[WriteStamp]] = {}
        for grant, size in claims:
            by_node.setdefault(grant.node_id, []).append(grant_stamp(grant, size))
        for node_id, stamps in by_node.items():
            with contextlib.suppress(KVPoolError, *TRANSFER_ERRORS, KeyError):
                fenced.ops(self._session.control(node_id), w.OP_RELEASE, stamps)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

    def _claim(self) -> None:
        session = self._session
        by_node: dict[str, list[tuple[Grant, int]]] = {}
        for grant, size in self._grants.to_claim():
            by_node.setdefault(grant.node_id, []).append((grant, size))
        for node_id, items in by_node.items():
            ok = [False] * len(items)
            at_ns = now_ns()  # before the claims leave: the node grants them later
            try:
                if session.regions.get(node_id) is not None and not isinstance(
                    session.transport(node_id), TcpTransport
                ):
                    stamps = [grant_stamp(g, size) for g, size in items]
                    statuses = fenced.ops(session.control(node_id), w.OP_CLAIM, stamps)
                    ok = [st == fenced.OK for st in statuses]
            except (KVPoolError, *TRANSFER_ERRORS) as exc:
                log.debug("could not claim grants on %s ahead: %s", node_id, exc)
            # grants dropped while their claims were on the way: release them now
            self._release(self._grants.claimed(items, ok, at_ns))
