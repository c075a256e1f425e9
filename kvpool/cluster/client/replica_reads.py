"""Reading a leased block's bytes from its replicas, and what a failing node does to that.

A read copies from one replica: the one ``ClientSession.preferred`` names (same
host first, a node seen failing last), then the others in order. A replica
that left its range (``StaleReadError``: evicted, reused) is skipped; a node
whose transfer fails (a dead process, an unreachable host, no answer within
the transport timeout) is reported to ``ClientSession.suspects`` and skipped.
While a node is suspected one read a second tries it and every other read
skips it (``Suspects.may_read``): without that, every read of a block only a
dead host held waited the whole timeout until the master dropped the node.
A read that succeeds on a suspected node clears the suspicion.

Invariants: never wrong bytes (same host: the block's identity record is
checked, kvpool.transport.shm_ident; TCP: the node checks it,
kvpool.transport.fencing); a miss is None, never an exception from a node's
failure; each skipped or failed try is counted (``read_node_skips``,
``read_node_failures``).
"""

from __future__ import annotations

from kvpool.bindings.buffers import Region
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession, Placement, Read
from kvpool.errors import StaleReadError, StaleWriteError
from kvpool.transport.shm import ShmTransport
from kvpool.transport.tcp import TcpTransport


def read_replicas(
    session: ClientSession,
    key: bytes,
    placements: list[Placement],
    dst: Region,
    start: int,
    want: int,
) -> int | None:
    """Bytes [start, start+want) of the block ``key`` into ``dst`` from the best
    replica, falling back to the others; ``want``, or None if none serves."""
    ordered = placements
    if len(placements) > 1:
        first = session.preferred(placements)
        ordered = sorted(placements, key=lambda p: p is not first)
    suspects = session.suspects
    for placement in ordered:
        node_id = placement.node_id
        if not suspects.may_read(node_id):  # a suspected node another read tries now
            session.counts["read_node_skips"] += 1
            continue
        block = placement.offset
        if _read_allowed(session, node_id, [(block + start, dst, key, block)]):
            return want
    session.counts["misses"] += 1
    return None


def read_node(session: ClientSession, node_id: str, items: list[Read]) -> bool:
    """A batch's reads from one node (``read_from``) unless it is suspected: True
    once all landed (the node cleared, the reads counted as hits); False if it was
    skipped, failed (suspected now: ``node_failed``) or refused a block as stale --
    each read's fallback (``read_replicas``) then decides what that read gets."""
    # (suspected: one try a second; a yes is that try, so it is asked once per try)
    return session.suspects.may_read(node_id) and _read_allowed(session, node_id, items)


def _read_allowed(session: ClientSession, node_id: str, items: list[Read]) -> bool:
    """``read_node`` once ``may_read`` said yes: True once all landed, else False
    (failed: ``node_failed``; or a block refused as stale)."""
    try:
        read_from(session, node_id, items)
    except (StaleReadError, StaleWriteError):
        return False
    except TRANSFER_ERRORS:
        node_failed(session, node_id)
        return False
    session.suspects.cleared(node_id)
    session.counts["hits"] += len(items)
    return True


def read_from(session: ClientSession, node_id: str, items: list[Read]) -> None:
    """Reads (offset, destination, key, block offset) from one node; a same-host
    copy checks the block's identity record (kvpool.transport.shm_ident) the way
    the node checks a TCP read: ``StaleReadError`` if a block is not there."""
    transport = session.transport(node_id)
    # (TCP's exact type first: an isinstance miss against these ABCs runs a Python frame)
    if type(transport) is not TcpTransport and isinstance(transport, ShmTransport):
        for item, ok in zip(items, transport.read_blocks(items), strict=True):
            if not ok:  # not published? (a seal in shared memory the node has not adopted)
                session.read_checked(node_id, [item])
    else:
        session.read_many(node_id, items)


def node_failed(session: ClientSession, node_id: str) -> None:
    """A read's transfer to ``node_id`` failed: suspect it, count it."""
    session.suspects.report(node_id, by_read=True)
    session.counts["read_node_failures"] += 1
