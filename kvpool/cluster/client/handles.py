"""Handles the remote client gives out: a reserved block being written, a lease."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.bindings.buffers import Region
from kvpool.cluster.wire import COMMIT, DEFAULT_ALLOC_TTL, REVOKE, IdsRequest
from kvpool.embedded.handles import PiecewiseWriter
from kvpool.errors import KVPoolError

if TYPE_CHECKING:
    from kvpool.cluster.client.lease_cache import CachedLease
    from kvpool.cluster.client.remote_pool import RemotePool


@dataclass(frozen=True)
class Placement:
    node_id: str
    offset: int
    size: int = 0


class RemoteBlockWriter(PiecewiseWriter):
    """A block allocated on the master, filled on its node(s), visible after ``commit``.

    Every write goes to every replica; a failed write aborts the block. The
    master revokes allocations not committed within its TTL and may then hand
    the range to another block, so a writer refuses to write past
    ``deadline`` (a little before that TTL) rather than risk it.
    """

    def __init__(
        self,
        pool: RemotePool,
        key: bytes,
        size: int,
        placements: list[Placement],
        ids: list[int],
        deadline: float | None = None,
    ) -> None:
        self._pool, self.key, self.size = pool, key, size
        self._placements, self._ids = placements, ids
        # Without a deadline from the allocation reply, assume the default TTL.
        self.deadline = deadline or time.monotonic() + 0.9 * DEFAULT_ALLOC_TTL
        self.done = False

    def _write(self, offset: int, src: Region) -> None:
        if self.done:
            raise KVPoolError("this block writer is already committed or aborted")
        if time.monotonic() > self.deadline:
            raise KVPoolError("this block's reservation expired before it was written; retry")
        for placement in self._placements:
            self._pool._write(placement.node_id, placement.offset + offset, src)

    def commit(self) -> None:
        if self.done:
            raise KVPoolError("this block writer is already committed or aborted")
        self.done = True
        self._pool._rpc.call(COMMIT, IdsRequest(self._ids))

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._pool._rpc.submit(REVOKE, IdsRequest(self._ids))


class RemoteLease:
    """Blocks pinned on the master; reads of them need no further round trip.

    Releasing hands the lease to the client's lease cache, which gives it
    back to the master shortly after (see kvpool.cluster.client.lease_cache).
    """

    def __init__(
        self,
        pool: RemotePool,
        lease: CachedLease,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        nodes: Sequence[list[str]],
    ) -> None:
        self._pool, self._lease = pool, lease
        self.keys, self.sizes, self.nodes = list(keys), list(sizes), list(nodes)
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._unpin(self._lease)

    def __len__(self) -> int:
        return len(self.keys)

    def __enter__(self) -> RemoteLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
