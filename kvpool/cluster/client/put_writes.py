"""The write half of a distributed put: stamped writes to each node, then their seals.

``write_all`` writes every block of a batch to the nodes the master chose (or
that a grant names), each stamped with its allocation and key (one pipelined
exchange per node: kvpool.cluster.client.fenced). Same-host and UCX copies
are sealed after the copy; those seals are left in flight so the caller can
overlap them with the master's commit, and ``wait_for_seals`` collects them.
``write_or_give_back`` is what a put calls: ``write_all``, then the revokes.

Invariants:
- a block is in ``written`` only if its node acknowledged the whole write
  (TCP: the stamped write; same-host: the claim before the copy); a refused
  or failed write lands in ``lost`` (to retry) and its allocation in
  ``failed`` (to revoke, never commit);
- a block counts as acknowledged only once its seal is confirmed too:
  ``wait_for_seals`` returns the ones refused (the node started a new
  master term since the claim, or died), which the caller retries;
- ``read_back`` returns a sealed block's bytes only through the node's
  checked read: while that block still holds its range, never another's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.bindings.buffers import Region
from kvpool.cluster.client import fenced
from kvpool.cluster.client.acked import Acked, Recovery
from kvpool.cluster.client.grant_supply import GrantSupply
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession
from kvpool.cluster.wire import EXISTS, KeysRequest
from kvpool.errors import KVPoolError, PutFailedError
from kvpool.transport.fencing import WriteStamp

# (index into the batch, allocation or grant id, offset, master term, claimed ahead:
# 0 if not, else the clock in ns read before that claim was sent)
WriteItem = tuple[int, int, int, int, int]
#: node id -> the blocks to write there
Writes = dict[str, list[WriteItem]]
#: a block written whole, and the node holding it
Written = tuple[WriteItem, str]
#: seals in flight: (node id, batch indices, the call that waits for their statuses)
Sealing = tuple[str, list[int], Callable[[], list[int]]]
log = logging.getLogger("kvpool.cluster.client")


@dataclass
class WriteOutcome:
    """What ``write_all`` did: see the module's invariants."""

    written: list[Written] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)  # batch indices to retry
    failed: list[int] = field(default_factory=list)  # allocation / grant ids to revoke
    sealing: list[Sealing] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)  # nodes whose connection failed


def write_all(
    session: ClientSession,
    writes: Writes,
    keys: Sequence[bytes],
    regions: Sequence[Region],
    parents: Sequence[bytes | None],
    sizes: list[int],
) -> WriteOutcome:
    """Write every block, stamped with its allocation and key (one pipelined
    exchange per node); the seals stay in flight (the bytes are in place)."""
    done = WriteOutcome()
    for node_id, items in writes.items():
        stamped = [
            (WriteStamp(epoch, alloc_id, off, sizes[i], keys[i], parents[i]), regions[i])
            for i, alloc_id, off, epoch, _ in items
        ]
        claimed = {j: item[4] for j, item in enumerate(items) if item[4]}
        try:
            statuses, seals = session.write_blocks(node_id, stamped, claimed)
        except TRANSFER_ERRORS:
            done.failed += [item[1] for item in items]
            done.lost += [item[0] for item in items]
            done.dead.append(node_id)
            continue
        except BaseException:  # not a node failing: the put raises (write_or_give_back)
            # Seals in flight on other nodes first: each holds a data connection lent
            # out until they are collected (TcpTransport.stamped_later).
            wait_for_seals(done.sealing, [False] * len(keys))
            raise
        for item, status in zip(items, statuses, strict=True):
            if status == fenced.OK:
                done.written.append((item, node_id))
            else:  # stale or busy: that allocation can no longer be filled
                done.failed.append(item[1])
                done.lost.append(item[0])
        if seals is not None:
            done.sealing.append((node_id, [item[0] for item in items], seals))
    return done


def write_or_give_back(
    session: ClientSession,
    supply: GrantSupply,
    writes: Writes,
    keys: Sequence[bytes],
    regions: Sequence[Region],
    parents: Sequence[bytes | None],
    sizes: list[int],
) -> tuple[list[Written], list[int], list[Sealing]]:
    """``write_all``, then forget the nodes that failed and revoke what the nodes
    refused: (what was written, indices to retry, seals still in flight). When it
    raises instead (not a node failing: no transport reaches one from here, say),
    every allocation and grant of ``writes`` is revoked first: nothing of the put
    was acknowledged, and the keys it allocated would otherwise read as being
    stored (a put of them answered False) until the master expired them."""
    try:
        done = write_all(session, writes, keys, regions, parents, sizes)
    except BaseException:
        supply.revoke([item[1] for items in writes.values() for item in items])
        raise
    for node_id in done.dead:
        supply.node_failed(node_id)
    supply.revoke(done.failed)
    return done.written, done.lost, done.sealing


def wait_for_seals(sealing: list[Sealing], stored: list[bool]) -> list[int]:
    """Wait for the seals: a put is acknowledged only once its node knows the
    block is whole (then it outlives a master crash). Clears ``stored`` of, and
    returns, the indices whose seal was refused (the node started a new master
    term since the claim, or died): not acknowledged, to retry."""
    refused = []
    for node_id, indices, seals in sealing:
        try:
            statuses = seals()
        except TRANSFER_ERRORS as exc:
            statuses = [-1] * len(indices)
            log.warning("node %s did not confirm seals: %s", node_id, exc)
        for i, status in zip(indices, statuses, strict=True):
            if status != fenced.OK and stored[i]:
                stored[i] = False  # committed, but its node may not re-register it
                refused.append(i)
                log.info("node %s refused a seal (new master term?): retried", node_id)
    return refused


def read_back(
    session: ClientSession, items: Sequence[Acked]
) -> tuple[list[np.ndarray | None], set[int]]:
    """The sealed bytes of acknowledged puts, read back from their nodes (to put
    them again when their commit was refused): None where the node no longer holds
    that block at its range, or cannot be reached; and the indices of the items
    whose node could not be reached (unknown here now, or its process gone). A node
    found gone is neither read nor probed again for the items after (each try of a
    dead host can cost the transport timeout)."""
    copies: list[np.ndarray | None] = []
    unreachable: set[int] = set()
    gone: set[str] = set()
    for i, a in enumerate(items):
        if a.node_id in gone:
            unreachable.add(i)
            copies.append(None)
            continue
        staging = np.empty(a.size, np.uint8)
        ok = False
        try:
            control = session.control(a.node_id)
            ok = control.read_blocks([(a.offset, staging, a.key, a.offset)])[0]
        except (KeyError, KVPoolError, *TRANSFER_ERRORS) as exc:
            log.warning("could not read back block %s: %s", a.key.hex()[:16], exc)
            # unreachable: unknown here now (the master dropped it), or its port takes no
            # connection (its process is gone); a node that is only slow or stopped is not
            if isinstance(exc, KeyError) or (
                isinstance(exc, OSError) and not session.node_alive(a.node_id)
            ):
                unreachable.add(i)
                gone.add(a.node_id)
        copies.append(staging if ok else None)
    return copies, unreachable


#: ``put_once(keys, buffers, parents, replicas, use_grants=False)``: a classic put
ClassicPut = Callable[..., tuple[list[bool], list[int], str]]


def recover_puts(
    session: ClientSession, items: Sequence[Acked], put_once: ClassicPut
) -> list[Recovery]:
    """Put acknowledged blocks whose commit the master refused again, from the
    bytes their node sealed: a checked read (``read_back``), then a classic put.
    A ``Recovery`` per item (``acked.Recover``)."""
    copies, unreachable = read_back(session, items)
    back = [(a, c) for a, c in zip(items, copies, strict=True) if c is not None]
    if back:
        keys, parents = [a.key for a, _ in back], [a.parent for a, _ in back]
        try:
            bufs = [c for _, c in back]
            stored, full, why = put_once(keys, bufs, parents, 1, use_grants=False)
            if full or not all(stored):
                log.info("recovery put: stored %s, no room for %s %s", stored, full, why)
        except PutFailedError as exc:  # not visible yet: the caller tries again
            log.info("recovery put: %s", exc)
    found = session.rpc.call(EXISTS, KeysRequest([a.key for a in items]))
    outcome = []
    for i, (hit, copy) in enumerate(zip(found, copies, strict=True)):
        if hit:
            outcome.append(Recovery.VISIBLE)
        elif copy is not None:
            outcome.append(Recovery.PENDING)
        else:
            outcome.append(Recovery.NODE_LOST if i in unreachable else Recovery.GONE)
    if lost := outcome.count(Recovery.NODE_LOST):  # the only copy died with its node
        session.counts["put_lost_with_node"] += lost
    return outcome
