"""Claims taken ahead for stocked put grants: same-host puts skip a round trip, TCP ones a claim.

A same-host (shared-memory) write must hold its node's claim on the range
while it copies (kvpool.cluster.client.fenced). For a grant the claim can be
taken before the put: when a refill of grants arrives, a background thread
claims the new ones on their nodes in one pipelined exchange per node, with
a placeholder key (the seal names the real key and parent). A put that takes
a claimed grant then costs the copy + one round trip (seal and master commit
in parallel).

Over TCP the stamp rides in the write, which claims its range itself; on a node
that commits its TCP writes (the straight path, kvpool.cluster.client.sealed_put)
the grants are claimed ahead all the same, with the placeholder key ``TCP_AHEAD``:
the put's write then finds its range held and the node skips a fresh claim's
work on the put's critical path (the entry's look-up, insertion and overlap
checks: ~20 of a 1 MiB put's ~45 us of node Python after its header arrived;
issue 17, session 43). Not ``NO_KEY``: the node keeps such a claim as a plain
one, with no shared-memory record or seal deadline (a new term aborts it at
once), and a renewal, which restarts only that deadline, sends nothing for it.
A put's TCP write that fails or is refused releases the claim taken ahead for
it (another connection holds it; kvpool.cluster.client.fenced).

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
#: The key a TCP claim taken ahead names (any key but NO_KEY: see the module docstring);
#: the put's write names the block's own, which the node takes when it seals the block.
TCP_AHEAD = b"\xff" * 16
#: Claims of one exchange, first and at most (doubling between). A refill brings up to
#: 256 grants; claimed in one exchange, none was usable until the node had answered
#: all of them: 5.5-6.7 ms on a slow hour of the Intel VM, while a burst of 64 KiB
#: puts used a grant every ~19 us and ran out of claimed ones first, sending 4-8% of
#: its puts the general way (~1.5 ms each: 40-50% of the burst's time; issue 17,
#: session 36). A first chunk of 32 is claimed in a fraction of that.
FIRST_CHUNK, MAX_CHUNK = 32, 128


def grant_stamp(grant: Grant, size: int, key: bytes = NO_KEY) -> WriteStamp:
    """The stamp that claims or releases ``grant`` (a release matches any placeholder:
    the node compares allocations, not keys)."""
    return WriteStamp(grant.epoch, grant.alloc_id, grant.offset, size, key)


class GrantClaims:
    def __init__(self, session: ClientSession, grants: GrantStock) -> None:
        self._session, self._grants = session, grants
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvpool-claims")

    def claim_soon(self) -> None:
        """Claim the unclaimed stocked grants on a background thread."""
        with contextlib.suppress(RuntimeError):  # shut down: the client is closing
            self._worker.submit(lambda: self._claim_items(self._grants.to_claim()))

    def renew(self, items: list[tuple[Grant, int]]) -> None:
        """Claim these stocked grants again on a background thread (the stock marked
        them as being claimed: ``GrantStock.claims_older_than``): the node restarts
        their deadline for seals in shared memory (kvpool.cluster.sealed_claims)."""
        try:
            self._worker.submit(self._claim_items, items, True)
        except RuntimeError:  # shut down: the client is closing
            self._release(self._grants.claimed(items, [False] * len(items)))

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

    def _claim_items(self, grants: list[tuple[Grant, int]], renewal: bool = False) -> None:
        """Claim ``grants`` (marked as being claimed; a ``renewal``: claimed before),
        node by node, oldest first, in chunks of ``FIRST_CHUNK`` doubling up to
        ``MAX_CHUNK``: the straight path takes the oldest grant and needs its claim, so
        the first few arrive after a short exchange instead of after all of a refill's
        (see ``FIRST_CHUNK``)."""
        by_node: dict[str, list[tuple[Grant, int]]] = {}
        for grant, size in grants:
            by_node.setdefault(grant.node_id, []).append((grant, size))
        for node_id, items in by_node.items():
            start, chunk = 0, FIRST_CHUNK
            while start < len(items):
                part = items[start : start + chunk]
                failed = not self._claim_part(node_id, part, renewal)
                start, chunk = start + len(part), min(2 * chunk, MAX_CHUNK)
                if failed and start < len(items):  # the rest: not claimed (puts claim)
                    rest = items[start:]
                    self._release(self._grants.claimed(rest, [False] * len(rest)))
                    break

    def _claim_part(self, node_id: str, items: list[tuple[Grant, int]], renewal: bool) -> bool:
        """One pipelined ``OP_CLAIM`` exchange for ``items`` on their node, recorded in
        the stock; False when the node could not be asked (every claim counts as
        refused, and the caller stops asking it). Same host: ``NO_KEY`` claims; over
        TCP, to a node that commits TCP writes: ``TCP_AHEAD`` ones, and a ``renewal``
        keeps them as they are (nothing to restart); another TCP node: none."""
        session = self._session
        ok = [False] * len(items)
        at_ns = now_ns()  # before the claims leave: the node grants them later
        asked = False
        try:
            key = self._placeholder(node_id)
            if key == TCP_AHEAD and renewal:
                ok, asked = [True] * len(items), True  # the first claims still hold
            elif key is not None:
                stamps = [grant_stamp(g, size, key) for g, size in items]
                statuses = fenced.ops(session.control(node_id), w.OP_CLAIM, stamps)
                ok = [st == fenced.OK for st in statuses]
                asked = True
        except (KVPoolError, *TRANSFER_ERRORS) as exc:
            log.debug("could not claim grants on %s ahead: %s", node_id, exc)
        # grants dropped while their claims were on the way: release them now
        self._release(self._grants.claimed(items, ok, at_ns))
        return asked

    def _placeholder(self, node_id: str) -> bytes | None:
        """The key the claims taken ahead on ``node_id`` name (None: none are taken:
        the node is gone, or reached over TCP and not committing TCP writes)."""
        if self._session.regions.get(node_id) is None:
            return None
        data = self._session.transport(node_id)
        if not isinstance(data, TcpTransport):
            return NO_KEY
        return TCP_AHEAD if data.info.tcp_node_commits else None
