"""One same-host put on its shortest path: a copy and a seal record, nothing sent (issue 17).

A single put of a new key whose grant's claim was taken ahead, on a node
that commits the blocks sealed in shared memory (kvpool.cluster.node_commits),
needs no message at all: copy the bytes into the grant's range, write the
seal record that asks the node to commit the block, read the clock. Inside
the claim's deadline (kvpool.transport.shm_seal) the put is acknowledged,
and watched until its node answers (kvpool.cluster.client.node_watch).

This is that path alone, in a straight line. The general path
(``fenced.write_blocks_begin`` and ``RemotePutter._acknowledge``, built for
batches) did the same steps with list bookkeeping around them that cost
~16 us of a 1 MiB put's ~82 (0.69 -> 0.85 of a numpy copy, issue 17,
session 8). Anything else -- a failed copy, a range without a record, a
clock past the deadline -- returns False with nothing acknowledged, and the
caller takes the general path with the same grant: it copies the same bytes
again and seals over TCP (a record written here is then early news).
"""

from __future__ import annotations

from kvpool.bindings.buffers import Region
from kvpool.cluster.client.commits import Acked, CommitPipe
from kvpool.cluster.client.grants import Grant
from kvpool.cluster.client.session import TRANSFER_ERRORS
from kvpool.transport.base import Transport
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm_seal import SealRecords, now_ns


def put_sealed(
    grant: Grant,
    claimed_at: int,
    key: bytes,
    region: Region,
    parent: bytes | None,
    size: int,
    data: Transport,
    seals: SealRecords,
    commits: CommitPipe,
) -> bool:
    """Copy ``region`` into ``grant``'s range (its claim taken ahead at
    ``claimed_at``, clock ns) and seal it asking the node to commit it; True
    if acknowledged (``commits`` watches it), False if the caller must take the
    general path (see the module docstring)."""
    stamp = WriteStamp(grant.epoch, grant.alloc_id, grant.offset, size, key, parent)
    try:
        data.write(grant.offset, region)
    except TRANSFER_ERRORS:
        return False
    if not seals.write(stamp, node_commits=True):
        return False
    if not seals.deadline.writer_in_time(claimed_at, now_ns()):  # read after the record
        return False
    commits.watch(
        Acked(key, parent, grant.alloc_id, grant.node_id, grant.offset, size, True), seals
    )
    return True
