"""The distributed read: lease, copy from a replica, hand the lease back later.

Every read runs under a lease, so the master cannot free or reuse a block's
range while it is copied. Leases are cached (kvpool.cluster.client.lease_cache):
a repeated read of a block skips the master. A read whose node fails tries
the block's other replicas and is a miss only when none serves, never wrong
bytes. A lease reply may carry *replica orders* (the master wants a hot
block copied to another node): the read that copies the whole block fulfils
it on the way; or *busy* (no DRAM room for SSD blocks): the client hands back
its cached leases and asks again (both: kvpool.cluster.client.lease_replies).

Invariants:
- an entry ``resolve`` returns pins its lease once until the caller unpins
  it, so the cache never hands back a lease while one of its blocks is copied
  (a batch served from the cache alone: one pin per position, ``pin_all``);
- a replica order is fulfilled (written and committed) only from a read of
  the whole block, and revoked when its lease is handed back unfulfilled;
- argument checks are the caller's (``kvpool.args``); range checks against
  the block's size happen here, before any byte moves.
Thread-safe: one lock guards the lease cache and the replica orders.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvpool.api import Buffer
from kvpool.args import Ranges, block_range, check_out_fits, out_region
from kvpool.bindings.buffers import Region, plain_host, region_nbytes
from kvpool.cluster.client.handles import RemoteLease
from kvpool.cluster.client.lease_cache import CachedLease, LeaseCache
from kvpool.cluster.client.lease_replies import Order, fulfil_order, wait_for_room
from kvpool.cluster.client.replica_reads import node_failed, read_node, read_replicas
from kvpool.cluster.client.session import TRANSFER_ERRORS, ClientSession, Placement, Read
from kvpool.cluster.wire import (
    LEASE,
    RELEASE,
    REVOKE,
    IdsRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseRequest,
)
from kvpool.errors import KVPoolError
from kvpool.transport.shm import ShmTransport
from kvpool.transport.tcp import TcpTransport

#: A leased block: its replicas, its size and the cached lease that pins it.
Found = tuple[list[Placement], int, CachedLease]
_NDARRAY = np.ndarray  # a global, not a module attribute load, on the batch's hot loop


class LeasedReads:
    """Reads, leases and the lease cache of one cluster client."""

    def __init__(self, session: ClientSession, hold_s: float, max_bytes: int) -> None:
        self._session = session
        self._lock = threading.Lock()
        self._renewing = threading.Lock()  # held through a renewal's round trip
        self.cache = LeaseCache(hold_s, max_bytes)
        # hot blocks to copy to a new replica: key -> (alloc id, target, lease that asked)
        self._orders: dict[bytes, Order] = {}

    # -- what the pool's read methods call -------------------------------------------

    def read_into(self, key: bytes, dst: Region, start: int, length: int | None) -> int | None:
        """``get_into``: from a cached lease when there is one, else after a LEASE.

        The common read takes one step, in this one frame (each call on this path
        costs ~0.4 us on a cold CPU, after the previous read's megabyte left the
        caches: issue 17, session 43): a whole cached block with one replica into a
        buffer of exactly its size (a device buffer too: the transport stages it), no
        replica order pending, its node not suspected. Where that does not apply, or
        its read failed or was refused (nothing counted, ``dst`` holds no meaningful
        bytes), the general path (``read_range``) takes it: it tries again, falls
        back to other replicas and counts the miss. Same checks either way: the
        transport verifies the block's identity (same host) or the node does (TCP)."""
        lock = self._lock  # acquire/release, not ``with``: every read comes here twice
        lock.acquire()  # fast path: a cached lease, no generator, no dict of one
        try:
            hit = self.cache.lookup(key)
            if hit is not None:
                hit[2].pins += 1
        finally:
            lock.release()
        if hit is None:
            with self.reading([key]) as found:
                if key not in found:
                    return None
                return self.read_range(key, found[key], dst, start, length)
        try:
            placements, size, _ = hit
            if (
                start == 0
                and length is None
                and len(placements) == 1
                and (dst.nbytes if type(dst) is _NDARRAY else region_nbytes(dst)) == size
                and key not in self._orders  # (racy: an order seen late is fulfilled later)
            ):
                placement = placements[0]
                node_id = placement.node_id
                session = self._session
                suspects = session.suspects
                if suspects.may_read(node_id):  # (suspected: ``read_replicas`` skips it and counts)
                    try:
                        transport = session.transport(node_id)
                        # shm: the identity-checked copy; TCP: the node checks the block
                        # (kvpool.transport.fencing); False: that block is not (or not yet) there
                        # (TCP's exact type first: an isinstance miss costs an ABC's frame)
                        if type(transport) is TcpTransport or isinstance(transport, ShmTransport):
                            ok = transport.read_block(placement.offset, 0, dst, key)
                        else:
                            block = placement.offset
                            session.read_many(node_id, [(block, dst, key, block)])
                            ok = True
                    except TRANSFER_ERRORS:  # the general path skips that node now
                        node_failed(session, node_id)
                    else:
                        if ok:
                            suspects.cleared(node_id)
                            session.counts["hits"] += 1
                            return size
            return self.read_range(key, hit, dst, start, length)
        finally:
            lock.acquire()
            hit[2].pins -= 1  # LeaseCache.unpin, inlined
            lock.release()

    def read_batch(
        self, keys: Sequence[bytes], outs: Sequence[Buffer], ranges: Ranges | None = None
    ) -> list[int | None]:
        """``get_into_batch``: one pipelined exchange per node, replicas on failure.
        ``ranges``: (starts, lengths) of the reads (``args.check_read_ranges``), None
        for whole blocks. Every destination is checked (``out_region``), and against
        its range in its block (a range past the end raises), before any read."""
        self._session.check_open()
        lock = self._lock
        lock.acquire()  # (acquire/release, not ``with``: the batch's hot path)
        hits = self.cache.pin_all(keys)
        lock.release()
        if hits and (read := self._read_cached(keys, outs, hits, ranges)) is not None:
            return read
        regions = [o if plain_host(o, writable=True) else out_region(o) for o in outs]
        found = self._resolve(keys)
        try:
            sizes: list[int | None] = [None] * len(keys)
            # node -> (indices, reads) of the blocks read from it
            by_node: dict[str, tuple[list[int], list[Read]]] = {}
            preferred = self._session.preferred
            for i, key in enumerate(keys):
                hit = found.get(key)
                if hit is None:
                    continue
                placements, size, _ = hit
                start, want = (0, size) if ranges is None else _range(ranges, i, size)
                region = regions[i]
                have = region.nbytes if type(region) is _NDARRAY else region_nbytes(region)
                if have != want:
                    check_out_fits(region, want)  # raises the usual error when short
                    region = region[:want]
                sizes[i] = want
                placement = placements[0] if len(placements) == 1 else preferred(placements)
                located = by_node.get(placement.node_id)
                if located is None:
                    located = by_node[placement.node_id] = ([], [])
                located[0].append(i)
                located[1].append((placement.offset + start, region, key, placement.offset))
            for node_id, (indices, plan) in by_node.items():  # one exchange per node
                if read_node(self._session, node_id, plan):
                    continue
                for i in indices:  # failed or skipped there: each tries its other replicas
                    start, take = (0, None) if ranges is None else (ranges[0][i], ranges[1][i])
                    sizes[i] = self.read_range(keys[i], found[keys[i]], regions[i], start, take)
            return sizes
        finally:
            self._unpin_found(found)

    def _read_cached(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Buffer],
        hits: list[Found],
        ranges: Ranges | None,
    ) -> list[int | None] | None:
        """The common batch in one pass (``hits``: ``pin_all``'s, unpinned here): every
        block cached with one replica, all on one node, each destination a plain host
        array of its range's size (``ranges`` as ``read_batch``'s; a range past its
        block's end raises), read in one pipelined exchange. Their sizes; or
        None when the batch is not that one, or its read failed or was refused: no
        read counted, and the caller's general path takes the batch whole (its checks,
        errors, replicas and misses; a failed node is suspected already, so it is not
        tried twice within ``suspects.retry_s``). With the native call taking TCP's
        reads as they are (kvpool.transport.tcp_conn), a batch of 256 x 64 B from the
        cache: 2.9-3.3 -> 2.3-2.6 us per block over TCP, 1.1-1.2 -> 1.0 us same-host
        (session 41; the node's share included)."""
        first = hits[0][0]  # (placements of the first block; none: the loop declines)
        node_id = first[0].node_id if first else ""
        items: list[Read] = []
        sizes: list[int | None] = []
        read = False
        try:
            for i, (key, out, hit) in enumerate(zip(keys, outs, hits, strict=True)):
                placements, size, _ = hit
                start, want = (0, size) if ranges is None else _range(ranges, i, size)
                if len(placements) != 1 or not plain_host(out, writable=True) or out.nbytes != want:
                    return None
                block = placements[0]
                if block.node_id != node_id:
                    return None
                items.append((block.offset + start, out, key, block.offset))
                sizes.append(want)
            read = read_node(self._session, node_id, items)
        finally:
            with self._lock:
                if read:
                    self.cache.unpin_read(keys, hits)
                else:
                    self.cache.unpin_all([lease for _, _, lease in hits])
        return sizes if read else None

    def lease(self, keys: Sequence[bytes], prefix: bool) -> RemoteLease:
        """Pin the stored prefix of ``keys`` (or every stored key) until released."""
        lease, held = self.take_lease(keys, prefix, pins=1)
        return RemoteLease(
            [k for k, _, _ in held],
            [s for _, _, s in held],
            [[p.node_id for p in placements] for _, placements, _ in held],
            lambda: self._unpin(lease),
        )

    def forget(self, key: bytes) -> None:
        """This client removes ``key``: stop serving it from the cache, and hand back
        at once every unpinned lease that holds it (before the remove, on the same
        connection, so the master frees the range). Waits for a renewal in flight:
        one sent before the remove must not bring the removed block back."""
        with self._renewing, self._lock:
            done = self.cache.forget(key)
        if done:
            self.hand_back(done, wait=False)

    # -- leases ------------------------------------------------------------------------

    @contextmanager
    def reading(self, keys: Sequence[bytes]) -> Iterator[dict[bytes, Found]]:
        """Where each stored key can be read, its lease pinned until the block exits
        (so the cache never hands a lease back while one of its blocks is copied)."""
        found = self._resolve(keys)
        try:
            yield found
        finally:
            self._unpin_found(found)

    def _unpin_found(self, found: dict[bytes, Found]) -> None:
        """Unpin once per entry ``_resolve`` returned."""
        with self._lock:
            self.cache.unpin_all([lease for _, _, lease in found.values()])

    def _resolve(self, keys: Sequence[bytes]) -> dict[bytes, Found]:
        """From the lease cache, else from one LEASE round trip for all the rest (their
        lease then joins the cache); every entry returned pins its lease once."""
        self._session.check_open()
        with self._lock:
            found = self.cache.pin_many(keys)
        if len(found) == len(keys):  # every key found (each once): no round trip
            return found
        # each key once: the lease pins one per block it holds, unpinned one per entry
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        if missing:
            lease, held = self.take_lease(missing, prefix=False, pins=-1)
            for key, placements, size in held:
                found[key] = (placements, size, lease)
        return found

    def renew_hot(self, within: float) -> int:
        """Re-lease, in one round trip, every cached block read under a lease that
        ends within ``within`` seconds (the janitor calls this each tick, off the
        read path); the leases they replace go back with their read counts. A key
        the master no longer has stays served by its old lease until that ends
        (as without renewal). Returns how many keys were renewed."""
        if self.cache.hold_s <= 0 or self._session.closed:
            return 0
        with self._renewing:  # no ``forget`` between choosing the keys and caching the reply
            with self._lock:
                keys = self.cache.renewable(within)
            if keys:
                self.take_lease(keys, prefix=False, pins=0, renewal=True)
        return len(keys)

    def take_lease(
        self, keys: Sequence[bytes], prefix: bool, pins: int, renewal: bool = False
    ) -> tuple[CachedLease, list[tuple[bytes, list[Placement], int]]]:
        """LEASE round trip; the lease joins the cache with ``pins`` holders (-1: one
        per block held, for readers that unpin block by block: a lease for a read,
        see ``LeaseCache.renewable``). A ``renewal`` (blocks
        already held) counts apart and never empties the cache to make room."""
        session = self._session
        request = LeaseRequest(list(keys), prefix)
        session.counts["lease_renewals" if renewal else "lease_round_trips"] += 1
        reply = session.rpc.call(LEASE, request, response_type=LeaseReply)
        if reply.busy and not renewal:
            reply = wait_for_room(session, request, reply, self.release_cached)
        session.learn(reply.nodes)
        held = [
            (key, [Placement(n, o, block[0]) for n, o in block[1]], block[0])
            for key, block in zip(keys, reply.blocks, strict=False)
            if block is not None
        ]
        if not renewal:  # a renewal's misses were counted as hits when read
            session.counts["misses"] += len(keys) - len(held)
        with self._lock:
            lease = self.cache.add(
                reply.lease_id, held, reply.ttl, len(held) if pins < 0 else pins, for_read=pins < 0
            )
            superseded = self.cache.superseded
            for index, alloc_id, node_id, offset in reply.replicate:
                placement = Placement(node_id, offset)
                self._orders[keys[index]] = (alloc_id, placement, reply.lease_id, reply.epoch)
        if superseded:
            self.hand_back(superseded, wait=False)
        return lease, held

    def _unpin(self, lease: CachedLease) -> None:
        with self._lock:
            self.cache.unpin(lease)
        self.hand_back_due()

    def release_cached(self) -> bool:
        """Hand back every unpinned cached lease and wait for the master to take them;
        True if there were any (so a retry may now find room)."""
        with self._lock:
            due = self.cache.due(unpinned=True)
        self.hand_back(due, wait=True)
        return bool(due)

    def hand_back_due(self, everything: bool = False) -> None:
        """Release the leases the cache is done with (all of them when closing)."""
        if self._session.closed and not everything:
            return
        with self._lock:
            due = self.cache.due(everything)
        self.hand_back(due, wait=everything)

    def hand_back(self, due: list[CachedLease], wait: bool) -> None:
        """RELEASE ``due`` leases with the reads they served; give back replica orders
        whose block was never read whole. Without ``wait`` nothing blocks: if the master
        is unreachable the leases expire there anyway."""
        rpc = self._session.rpc
        with self._lock:
            # Replica orders that came with these leases and were never fulfilled.
            orphans = [
                self._orders.pop(k)[0]
                for d in due
                for k in d.keys
                if k in self._orders and self._orders[k][2] == d.lease_id
            ]
        if orphans:
            rpc.submit(REVOKE, IdsRequest(orphans))
        ids = [d.lease_id for d in due if d.lease_id]
        if ids:
            release = ReleaseRequest(ids, [[k, n] for d in due for k, n in d.reads.items()])
            with contextlib.suppress(KVPoolError):
                if wait:
                    rpc.call(RELEASE, release)
                else:
                    rpc.submit(RELEASE, release)

    # -- bytes -------------------------------------------------------------------------

    def read_range(
        self, key: bytes, found: Found, dst: Region, start: int, length: int | None
    ) -> int | None:
        """Bytes [start, start+length) of a leased block into ``dst``; None if no
        replica serves. A whole-block read fulfils the block's replica order."""
        placements, size, _ = found
        want = block_range(start, length, size)
        check_out_fits(dst, want)
        got = read_replicas(self._session, key, placements, dst[:want], start, want)
        with self._lock:
            order = self._orders.pop(key, None) if got == size else None
        if order is not None:
            fulfil_order(self._session, key, order, dst[:want])
        return got


def _range(ranges: Ranges, i: int, size: int) -> tuple[int, int]:
    """Read ``i``'s (start, bytes) in its block of ``size`` (past its end: raises)."""
    start, take = ranges[0][i], ranges[1][i]
    return start, size if not start and take is None else block_range(start, take, size)
