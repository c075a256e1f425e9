"""Reserved blocks of the cluster client: many in one master round trip, or adopted.

``reserve_blocks`` asks the master for every block of a batch in one
``ALLOCATE`` (what ``RemotePool.reserve`` and ``reserve_batch`` send): a
reserve per block had cost a master round trip each (~250 us on the 2 vCPU
VMs of bench/RESULTS.md, more when the master's CPU had gone idle), so a
prompt of 32 layers x 64 blocks waited 64 round trips before its first byte
moved. ``adopt`` makes a writer onto a reservation another process exported.

Invariants:

- all or nothing: when the master cannot place some block (the cluster is
  full), the allocations it made for the others are revoked (one more round
  trip, waited) before ``PoolFullError`` is raised, so a failed batch leaves
  no reservation behind, not even one the master would drop at its TTL (only
  a master that fails in between leaves them to that TTL);
- a key already stored, in flight elsewhere, or named earlier in the same
  batch answers None, in its place: the master allocates a key once;
- every writer of a batch shares the reply's epoch and deadline (0.9 of the
  master's allocation TTL from the moment the reply arrived).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from kvpool.cluster.client.handles import RemoteBlockWriter, ReservationTicket
from kvpool.cluster.client.session import ClientSession
from kvpool.cluster.wire import ALLOCATE, REVOKE, AllocateReply, AllocateRequest, IdsRequest
from kvpool.errors import KVPoolError, PoolFullError
from kvpool.transport.base import RegionInfo


def reserve_blocks(
    session: ClientSession,
    keys: Sequence[bytes],
    sizes: Sequence[int],
    parents: Sequence[bytes | None],
) -> list[RemoteBlockWriter | None]:
    """One writer (or None) per key, from one ``ALLOCATE`` (arguments already
    checked); raises ``PoolFullError`` with nothing reserved if any block found
    no room (see the module docstring)."""
    session.check_open()
    if not keys:
        return []
    request = AllocateRequest(
        list(keys), list(sizes), list(parents), avoid=session.suspects.current()
    )
    reply = session.rpc.call(ALLOCATE, request, response_type=AllocateReply)
    session.learn(reply.nodes)
    if reply.error:
        placed = [int(a[0]) for p in reply.placements if p for a in p]
        if placed:
            with contextlib.suppress(KVPoolError):  # else the master's TTL frees them
                session.rpc.call(REVOKE, IdsRequest(placed))  # waited: gone when we raise
        raise PoolFullError(reply.error)
    deadline = time.monotonic() + 0.9 * reply.ttl
    return [
        None
        if allocations is None
        else RemoteBlockWriter(
            session, key, size, allocations, deadline, epoch=reply.epoch, parent=parent
        )
        for key, size, parent, allocations in zip(
            keys, sizes, parents, reply.placements, strict=True
        )
    ]


def adopt(session: ClientSession, ticket: ReservationTicket) -> RemoteBlockWriter:
    """A writer onto a reservation another process exported
    (``RemoteBlockWriter.export``): writes go to the same reserved space; the
    deadline is the ticket's time left, re-based on this process's clock."""
    session.check_open()
    session.learn({n: RegionInfo.from_dict(d) for n, d in ticket.nodes.items()})
    deadline = time.monotonic() + ticket.ttl_s
    return RemoteBlockWriter(
        session,
        ticket.key,
        ticket.size,
        ticket.allocations,
        deadline,
        epoch=ticket.epoch,
        parent=ticket.parent,
    )
