"""What a LEASE reply may ask of a reading client besides where its blocks are.

- ``busy``: the master found SSD-only blocks and no DRAM room to promote them
  into (every DRAM block there is leased or being written). ``wait_for_room``
  hands back this client's own cached leases and asks again, with backoff for
  up to ``BUSY_WAIT_S`` while still busy, before those blocks count as misses.
- replica orders: the master wants a hot block copied to another node. The
  read that copies the whole block fulfils the order on the way
  (``fulfil_order``): the copy is written to the allocation the master made and
  committed, or the allocation is given back when the write fails.

Invariant: every superseded busy reply's lease goes back at once (RELEASE), and an
order's allocation ends committed or revoked, never left to its TTL by a failure
seen here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpool.bindings.buffers import Region, region_nbytes
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession, Placement
from kvpool.cluster.wire import (
    COMMIT,
    LEASE,
    RELEASE,
    REVOKE,
    IdsRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseRequest,
)
from kvpool.transport.fencing import WriteStamp

#: A replica order from a lease: (allocation id, target, lease id, master term)
Order = tuple[int, Placement, int, int]

#: How long a read waits for DRAM room to promote SSD-only blocks into, before
#: they count as misses (a read of SSD blocks while every DRAM block is leased):
#: longer than another client's cached lease outlives its last read (the default
#: hold, 1 s, plus a janitor tick, 0.5 s).
BUSY_WAIT_S = 2.0


def wait_for_room(
    session: ClientSession,
    request: LeaseRequest,
    reply: LeaseReply,
    release_cached: Callable[[], bool],
) -> LeaseReply:
    """Ask ``request`` again while its ``reply`` is busy: first after handing back
    this client's cached leases (``release_cached``: True if there were any), then
    with backoff (other clients' cached leases end within their hold, the janitor's
    hand-backs land) for up to ``BUSY_WAIT_S``; the last reply."""
    give_up, pause = time.monotonic() + BUSY_WAIT_S, 0.005
    while reply.busy:
        if not release_cached():  # nothing of ours to free: give others time
            left = give_up - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.1)
        elif time.monotonic() > give_up:
            break
        session.rpc.submit(RELEASE, ReleaseRequest([reply.lease_id] if reply.lease_id else []))
        session.counts["lease_busy_retries"] += 1
        reply = session.rpc.call(LEASE, request, response_type=LeaseReply)
    return reply


def fulfil_order(session: ClientSession, key: bytes, order: Order, block: Region) -> None:
    """Copy a just-read hot block to the replica the master asked for (or give it back)."""
    alloc_id, target, _, epoch = order
    stamp = WriteStamp(epoch, alloc_id, target.offset, region_nbytes(block), key)
    try:
        session.write_block(target.node_id, stamp, block)
    except TRANSFER_ERRORS:
        session.rpc.submit(REVOKE, IdsRequest([alloc_id]))
        return
    session.rpc.submit(COMMIT, IdsRequest([alloc_id]))  # no need to wait
    session.counts["replicas_added"] += 1
