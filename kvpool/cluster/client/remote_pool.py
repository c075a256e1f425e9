"""``kvpool.connect(url)``: the cluster-wide pool, with exactly the embedded API.

Metadata goes to the master (one round trip per batch and phase); bytes go
straight between this process and the nodes over the fastest transport per
node (shared memory on the same host, else UCX or TCP; see
kvpool.transport.select). Reads run under a lease, so the master cannot
free or reuse a block's range while it is copied; a read that outlives its
lease, or whose node fails, is answered from another replica or as a miss,
never with wrong bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import numpy as np

from kvpool.args import check_key, check_keys, data_region
from kvpool.bindings.buffers import Region, as_region, region_nbytes
from kvpool.cluster.client.grants import grant_budget
from kvpool.cluster.client.handles import Placement, RemoteBlockWriter, RemoteLease
from kvpool.cluster.client.lease_cache import (
    DEFAULT_HOLD_S,
    DEFAULT_MAX_BYTES,
    CachedLease,
    LeaseCache,
)
from kvpool.cluster.client.puts import RemotePutter
from kvpool.cluster.wire import (
    ALLOCATE,
    COMMIT,
    EXISTS,
    LEASE,
    LOCATE,
    PREFIX,
    RELEASE,
    REMOVE,
    REPLICATE,
    REVOKE,
    STATS,
    AllocateReply,
    AllocateRequest,
    IdsRequest,
    KeysRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseRequest,
    ReplicateReply,
    ReplicateRequest,
)
from kvpool.config import DEFAULT_PORT
from kvpool.errors import BufferSpecError, KVPoolError, PoolClosedError, PoolFullError
from kvpool.layerwise.api import LayerwiseMethods
from kvpool.rpc.client import RpcClient
from kvpool.transport.base import RegionInfo, Transport, host_identity
from kvpool.transport.peers import PeerTransports

_READ_ERRORS = (ConnectionError, TimeoutError, OSError)


def connect(url: str, *, token: str | None = None, timeout: float = 10.0, **kw: Any) -> RemotePool:
    """A pool backed by the cluster whose master is at ``kvpool://HOST:PORT``."""
    parsed = urlparse(url if "://" in url else f"kvpool://{url}")
    if parsed.scheme != "kvpool" or not parsed.hostname:
        raise ValueError(f"expected kvpool://HOST:PORT, got {url!r}")
    return RemotePool(
        f"{parsed.hostname}:{parsed.port or DEFAULT_PORT}", token=token, timeout=timeout, **kw
    )


class RemotePool(LayerwiseMethods):
    """put/get/get_into/exists/prefix_match/remove/stats, batch forms, reserve, lease."""

    def __init__(
        self,
        master: str,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: str | None = None,
        contribute_dram: int = 0,
        lease_cache_s: float = DEFAULT_HOLD_S,
        lease_cache_bytes: int = DEFAULT_MAX_BYTES,
        put_grant_bytes: int | None = None,
    ) -> None:
        self.token, self.timeout = token, timeout
        self._rpc = RpcClient(master, token=token, timeout=timeout, name="kvpool-client")
        self._regions: dict[str, RegionInfo] = {}
        self._peers = PeerTransports(token=token, timeout=timeout, override=transport)
        self._by_region: dict[str, tuple[RegionInfo, Transport]] = {}  # skips peers' lock
        self._lock = threading.Lock()  # guards the lease cache and the replica orders
        self._cache = LeaseCache(lease_cache_s, lease_cache_bytes)
        # hot blocks to copy to a new replica: key -> (alloc id, target, lease that asked)
        self._orders: dict[bytes, tuple[int, Placement, int]] = {}
        self._counts: Counter[str] = Counter()
        self._closed = False
        self._stop = threading.Event()
        self._janitor = threading.Thread(
            target=self._hand_back_loop, name="kvpool-lease-cache", daemon=True
        )
        self._janitor.start()
        self._putter = RemotePutter(self, grant_budget(put_grant_bytes))
        self._node = self._contribute(master, contribute_dram) if contribute_dram else None

    # -- writes -------------------------------------------------------------------

    def put(self, key: bytes, data: Any, *, parent: bytes | None = None, replicas: int = 1) -> bool:
        """Store ``data`` under ``key``; False if it is already stored (or if its
        write failed twice, on the nodes the master chose: then nothing is visible)."""
        return self.put_batch([key], [data], [parent], replicas=replicas)[0]

    def put_batch(
        self,
        keys: Sequence[bytes],
        datas: Sequence[Any],
        parents: Sequence[bytes | None] | None = None,
        *,
        replicas: int = 1,
    ) -> list[bool]:
        """Store each block; one commit round trip for the whole batch, plus one
        allocation round trip for blocks that found no grant (kvpool.cluster.client.puts).

        ``replicas`` > 1 places copies on distinct nodes (best effort).
        """
        parents = list(parents) if parents is not None else [None] * len(keys)
        if not len(keys) == len(datas) == len(parents):
            raise ValueError("keys, datas and parents must have the same length")
        check_keys(keys, parents)
        regions = [data_region(d) for d in datas]
        self._check_open()
        stored, full, error = self._putter.put_once(keys, regions, parents, replicas)
        if full and self._release_cached():  # our own cached leases may be what blocks it
            again, still, error = self._putter.put_once(
                [keys[i] for i in full],
                [regions[i] for i in full],
                [parents[i] for i in full],
                replicas,
            )
            for i, ok in zip(full, again, strict=True):
                stored[i] = ok
            full = [full[j] for j in still]
        self._counts["puts"] += sum(stored)
        if full:
            raise PoolFullError(error)
        return stored

    def reserve(
        self, key: bytes, size: int, *, parent: bytes | None = None, device: bool = False
    ) -> RemoteBlockWriter | None:
        """Reserve a block to fill piecewise (see ``Pool.reserve``); None if already stored."""
        check_key(key)
        if parent is not None:
            check_key(parent, what="parent")
        if not isinstance(size, int) or size <= 0:
            raise BufferSpecError(f"size must be a positive int, got {size!r}")
        self._check_open()
        reply = self._rpc.call(
            ALLOCATE, AllocateRequest([key], [size], [parent]), response_type=AllocateReply
        )
        self._learn(reply.nodes)
        if reply.error:
            raise PoolFullError(reply.error)
        placements = reply.placements[0]
        if placements is None:
            return None
        return RemoteBlockWriter(
            self,
            key,
            size,
            [Placement(n, o) for _, n, o in placements],
            [a for a, _, _ in placements],
            deadline=time.monotonic() + 0.9 * reply.ttl,
        )

    # -- reads --------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """A copy of the block's bytes, or None on a miss."""
        check_key(key)
        with self._reading([key]) as found:
            if key not in found:
                return None
            out = np.empty(found[key][1], np.uint8)
            got = self._read_range(key, found[key], out, 0, None)
        return None if got is None else out.tobytes()

    def get_into(
        self, key: bytes, out: Any, *, offset: int = 0, length: int | None = None
    ) -> int | None:
        """Copy the block (or bytes [offset, offset+length)) into ``out``; None on a miss."""
        check_key(key)
        dst = as_region(out, writable=True, what="out")
        if offset < 0 or (length is not None and length <= 0):
            raise BufferSpecError(f"bad range: offset={offset}, length={length}")
        with self._lock:  # fast path: a cached lease, no generator, no dict of one
            hit = self._cache.lookup(key)
            if hit is not None:
                hit[2].pins += 1
        if hit is None:
            with self._reading([key]) as found:
                if key not in found:
                    return None
                return self._read_range(key, found[key], dst, offset, length)
        try:
            return self._read_range(key, hit, dst, offset, length)
        finally:
            with self._lock:
                self._cache.unpin(hit[2])

    def get_into_batch(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """``get_into`` for each pair; at most one lease round trip for the whole batch."""
        if len(keys) != len(outs):
            raise ValueError("keys and outs must have the same length")
        check_keys(keys)
        regions = [as_region(o, writable=True, what="out") for o in outs]
        with self._reading(keys) as found:
            return self._read_batch(keys, regions, found)

    def _read_batch(
        self, keys: Sequence[bytes], regions: list[Region], found: dict[bytes, Any]
    ) -> list[int | None]:
        sizes: list[int | None] = [found[k][1] if k in found else None for k in keys]
        for size, region in zip(sizes, regions, strict=True):
            if size is not None and region_nbytes(region) < size:
                raise BufferSpecError(f"out has {region_nbytes(region)} bytes but {size} are asked")
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            if key in found:
                by_node.setdefault(self._preferred(found[key][0]).node_id, []).append(i)
        for node_id, items in by_node.items():
            plan = [
                (self._preferred(found[keys[i]][0]).offset, regions[i][: sizes[i]]) for i in items
            ]
            try:  # one pipelined exchange per node
                self._transport(node_id).read_many(plan)
                self._counts["hits"] += len(items)
            except _READ_ERRORS:  # that node failed: each block tries its other replicas
                for i in items:
                    sizes[i] = self._read_range(keys[i], found[keys[i]], regions[i], 0, None)
        return sizes

    def lease(self, keys: Sequence[bytes], *, prefix: bool = True) -> RemoteLease:
        """Pin the stored prefix of ``keys`` (or every stored key) until released."""
        check_keys(keys)
        self._check_open()
        lease, held = self._take_lease(keys, prefix, pins=1)
        return RemoteLease(
            self,
            lease,
            [k for k, _, _ in held],
            [s for _, _, s in held],
            [[p.node_id for p in placements] for _, placements, _ in held],
        )

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Node ids holding each key (empty where the key is not stored)."""
        check_keys(keys)
        self._check_open()
        return [list(nodes) for nodes in self._rpc.call(LOCATE, KeysRequest(list(keys)))]

    def replicate(self, keys: Sequence[bytes], node: str | None = None) -> int:
        """Copy stored blocks to ``node`` (or the emptiest node lacking them) as extra
        replicas; returns how many were added. The conductor uses this to move a
        prefix next to the prefill worker it routes a request to."""
        check_keys(keys)
        self._check_open()
        request = ReplicateRequest(list(keys), node or "")
        reply = self._rpc.call(REPLICATE, request, response_type=ReplicateReply)
        self._learn(reply.nodes)
        added: list[int] = []
        failed: list[int] = []
        with self._reading(keys) as found:
            self._copy_replicas(keys, reply.allocations, found, added, failed)
        if failed:
            self._rpc.submit(REVOKE, IdsRequest(failed))
        return sum(self._rpc.call(COMMIT, IdsRequest(added))) if added else 0

    def _copy_replicas(
        self,
        keys: Sequence[bytes],
        allocations: list[list[Any] | None],
        found: dict[bytes, Any],
        added: list[int],
        failed: list[int],
    ) -> None:
        for key, alloc in zip(keys, allocations, strict=True):
            if alloc is None:
                continue
            alloc_id, node_id, offset = alloc
            hit = found.get(key)
            staging = np.empty(hit[1] if hit else 0, np.uint8)
            if hit is None or self._read_replicas(hit[0], staging, 0, staging.size) is None:
                failed.append(alloc_id)
                continue
            try:
                self._write(node_id, offset, staging)
                added.append(alloc_id)
            except _READ_ERRORS:
                failed.append(alloc_id)

    # -- keys -----------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        self._check_open()
        return list(self._rpc.call(EXISTS, KeysRequest(list(keys))))

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        self._check_open()
        return int(self._rpc.call(PREFIX, KeysRequest(list(keys))))

    def remove(self, key: bytes) -> bool:
        check_key(key)
        self._check_open()
        with self._lock:
            done = self._cache.forget(key)
        if done is not None:
            self._hand_back([done], wait=False)  # before the remove, on the same connection
        return bool(self._rpc.call(REMOVE, KeysRequest([key]))[0])

    def stats(self) -> dict[str, Any]:
        self._check_open()
        stats = dict(self._rpc.call(STATS))
        stats["client"] = {
            **self._counts,
            "put_grants_used": self._putter.grants.used,
            "put_grant_refills": self._putter.grants.refills,
        }
        stats["transports"] = self._peers.stats()
        stats["transport"] = ",".join(sorted(stats["transports"])) or "-"
        return stats

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        with contextlib.suppress(KVPoolError):
            self._putter.close()  # before the waited release: same connection, in order
            self._hand_back_due(everything=True)
        self._closed = True
        self._peers.close()
        self._rpc.close()
        if self._node is not None:
            self._node.close()

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers (used by the handles too) -----------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the pool is closed")

    def _learn(self, nodes: dict[str, RegionInfo]) -> None:
        regions = self._regions
        for node_id, region in nodes.items():
            old = regions.get(node_id)
            regions[node_id] = region  # a restarted node's new region replaces its transport
            if old is not None and old != region:
                self._putter.forget_node(node_id)

    def _transport(self, node_id: str) -> Transport:
        region = self._regions[node_id]
        known = self._by_region.get(node_id)
        if known is not None and known[0] is region:  # the common case: nothing changed
            return known[1]
        transport = self._peers.get(region)
        self._by_region[node_id] = (region, transport)
        return transport

    def _write(self, node_id: str, offset: int, src: Region) -> None:
        """Bytes to a node's range (CUDA buffers: the transport stages them)."""
        self._transport(node_id).write(offset, src)

    @contextmanager
    def _reading(self, keys: Sequence[bytes]) -> Iterator[dict[bytes, tuple[Any, int, Any]]]:
        """Where each stored key can be read, its lease pinned until the block exits
        (so the cache never hands a lease back while one of its blocks is copied)."""
        found = self._resolve(keys)
        try:
            yield found
        finally:
            with self._lock:
                for _, _, lease in found.values():
                    self._cache.unpin(lease)

    def _resolve(self, keys: Sequence[bytes]) -> dict[bytes, tuple[Any, int, Any]]:
        """From the lease cache, else from one LEASE round trip for all the rest (their
        lease then joins the cache); every entry returned pins its lease once."""
        self._check_open()
        found: dict[bytes, tuple[Any, int, Any]] = {}
        with self._lock:
            for key in keys:
                hit = self._cache.lookup(key)
                if hit is not None:
                    hit[2].pins += 1
                    found[key] = hit
        missing = [k for k in keys if k not in found]
        if missing:
            lease, held = self._take_lease(missing, prefix=False, pins=-1)
            for key, placements, size in held:
                found[key] = (placements, size, lease)
        return found

    def _take_lease(
        self, keys: Sequence[bytes], prefix: bool, pins: int
    ) -> tuple[CachedLease, list[tuple[bytes, list[Placement], int]]]:
        """LEASE round trip; the lease joins the cache with ``pins`` holders (-1: one
        per block held, for readers that unpin block by block)."""
        request = LeaseRequest(list(keys), prefix)
        self._counts["lease_round_trips"] += 1
        reply = self._rpc.call(LEASE, request, response_type=LeaseReply)
        if reply.busy and self._release_cached():  # blocks on SSD found no room in memory
            self._rpc.submit(RELEASE, ReleaseRequest([reply.lease_id] if reply.lease_id else []))
            reply = self._rpc.call(LEASE, request, response_type=LeaseReply)
        self._learn(reply.nodes)
        held = [
            (key, [Placement(n, o, block[0]) for n, o in block[1]], block[0])
            for key, block in zip(keys, reply.blocks, strict=False)
            if block is not None
        ]
        self._counts["misses"] += len(keys) - len(held)
        with self._lock:
            lease = self._cache.add(
                reply.lease_id, held, reply.ttl, len(held) if pins < 0 else pins
            )
            superseded = self._cache.superseded
            for index, alloc_id, node_id, offset in reply.replicate:
                self._orders[keys[index]] = (alloc_id, Placement(node_id, offset), reply.lease_id)
        if superseded:
            self._hand_back(superseded, wait=False)
        return lease, held

    def _read_range(
        self, key: bytes, found: tuple[Any, int, Any], dst: Region, start: int, length: int | None
    ) -> int | None:
        placements, size, _ = found
        want = size - start if length is None else length
        if start + want > size or want <= 0:
            raise BufferSpecError(f"range [{start}, {start + want}) is outside the block of {size}")
        if region_nbytes(dst) < want:
            raise BufferSpecError(f"out has {region_nbytes(dst)} bytes but {want} are asked")
        got = self._read_replicas(placements, dst[:want], start, want)
        with self._lock:
            order = self._orders.pop(key, None) if got == size else None
        if order is not None:
            self._fulfil_order(order, dst[:want])
        return got

    def _read_replicas(
        self, placements: list[Placement], dst: Region, start: int, want: int
    ) -> int | None:
        """Read from the best replica, falling back to the others; None if none serves."""
        ordered = placements
        if len(placements) > 1:  # same host first
            ordered = sorted(placements, key=lambda p: p is not self._preferred(placements))
        for placement in ordered:
            try:
                self._read_from(placement, dst, start, want)
            except _READ_ERRORS:
                continue
            self._counts["hits"] += 1
            return want
        self._counts["misses"] += 1
        return None

    def _preferred(self, placements: list[Placement]) -> Placement:
        """The replica to read first: one on this host, else the master's first
        (least loaded)."""
        if len(placements) > 1:
            here = host_identity()
            for placement in placements:
                if self._regions[placement.node_id].host_id == here:
                    return placement
        return placements[0]

    def _fulfil_order(self, order: tuple[int, Placement, int], block: Region) -> None:
        """Copy a just-read hot block to the replica the master asked for (or give it back)."""
        alloc_id, target, _ = order
        try:
            self._write(target.node_id, target.offset, block)
        except _READ_ERRORS:
            self._rpc.submit(REVOKE, IdsRequest([alloc_id]))
            return
        self._rpc.submit(COMMIT, IdsRequest([alloc_id]))  # no need to wait
        self._counts["replicas_added"] += 1

    def _read_from(self, placement: Placement, dst: Region, start: int, want: int) -> None:
        self._transport(placement.node_id).read_into(placement.offset + start, dst)

    def _unpin(self, lease: CachedLease) -> None:
        with self._lock:
            self._cache.unpin(lease)
        self._hand_back_due()

    def _release_cached(self) -> bool:
        """Hand back every unpinned cached lease and wait for the master to take them;
        True if there were any (so a retry may now find room)."""
        with self._lock:
            due = self._cache.due(unpinned=True)
        self._hand_back(due, wait=True)
        return bool(due)

    def _hand_back_loop(self) -> None:
        """Give expired cached leases back even while the client is idle."""
        interval = max(0.05, self._cache.hold_s / 2)
        while not self._stop.wait(interval):
            with contextlib.suppress(KVPoolError, OSError):
                self._hand_back_due()
                self._putter.revoke_stale()

    def _hand_back_due(self, everything: bool = False) -> None:
        """Release the leases the cache is done with (all of them when closing)."""
        if self._closed and not everything:
            return
        with self._lock:
            due = self._cache.due(everything)
        self._hand_back(due, wait=everything)

    def _hand_back(self, due: list[CachedLease], wait: bool) -> None:
        """RELEASE ``due`` leases with the reads they served; give back replica orders
        whose block was never read whole. Without ``wait`` nothing blocks: if the master
        is unreachable the leases expire there anyway."""
        with self._lock:
            # Replica orders that came with these leases and were never fulfilled.
            orphans = [
                self._orders.pop(k)[0]
                for d in due
                for k in d.keys
                if k in self._orders and self._orders[k][2] == d.lease_id
            ]
        if orphans:
            self._rpc.submit(REVOKE, IdsRequest(orphans))
        ids = [d.lease_id for d in due if d.lease_id]
        if ids:
            release = ReleaseRequest(ids, [[k, n] for d in due for k, n in d.reads.items()])
            with contextlib.suppress(KVPoolError):
                if wait:
                    self._rpc.call(RELEASE, release)
                else:
                    self._rpc.submit(RELEASE, release)

    def _contribute(self, master: str, dram_bytes: int) -> Any:
        from kvpool.cluster.node import NodeConfig, StorageNode

        node = StorageNode(NodeConfig(master=master, dram_bytes=dram_bytes, token=self.token))
        node.start()
        if not node.registered.wait(self.timeout):
            node.close()
            raise KVPoolError(f"could not register this process's capacity with {master}")
        return node
