"""``kvpool master``: the cluster's metadata service.

Holds the block catalog (kvpool.index.catalog) behind msgpack RPC: node
registration and heartbeats, two-phase put allocation, read leases, key
queries and stats. It never touches block bytes: clients move them to and
from nodes directly. A reaper thread expires stale allocations and leases
and drops nodes whose heartbeats stopped for ``node_ttl`` seconds.

The master keeps no state on disk. After a restart, nodes find they are
unknown (heartbeat reply ``known=False``) and register again with the
blocks they hold, which rebuilds the catalog.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvpool.args import check_keys
from kvpool.cluster.metrics import Metrics
from kvpool.cluster.wire import (
    ALLOCATE,
    COMMIT,
    DEFAULT_ALLOC_TTL,
    EXISTS,
    HEARTBEAT,
    LEASE,
    LOCATE,
    PREFIX,
    REGISTER,
    RELEASE,
    REMOVE,
    REPLICATE,
    REVOKE,
    SSD_LOAD,
    SSD_STORE,
    STATS,
    AllocateReply,
    AllocateRequest,
    CommitRequest,
    Heartbeat,
    HeartbeatReply,
    IdsRequest,
    KeysRequest,
    LeaseReply,
    LeaseRequest,
    RegisterNode,
    ReleaseRequest,
    ReplicateReply,
    ReplicateRequest,
)
from kvpool.errors import KVPoolError
from kvpool.index.catalog import Allocation, BlockCatalog, BlockMeta, CatalogFullError
from kvpool.index.heat import ReplicationConfig
from kvpool.rpc.client import RpcClient
from kvpool.rpc.server import RpcServer, ServerConfig
from kvpool.transport.base import RegionInfo

log = logging.getLogger("kvpool.cluster.master")
DEFAULT_PORT = 7480
SSD_CLEAN_BATCH = 256 << 20  # bytes per node per reaper pass
MAX_GRANTS = 64  # keyless allocations one allocate call may hand out


@dataclass(frozen=True)
class MasterConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: str | None = None
    policy: str = "lru"
    node_ttl: float = 5.0  # a node silent this long is dead
    lease_ttl: float = 30.0
    alloc_ttl: float = DEFAULT_ALLOC_TTL
    reap_interval: float = 0.5
    metrics_port: int | None = None  # None: no /metrics server; 0: any free port
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    # Copy a node's DRAM blocks to its SSD once DRAM is this full (0: write every
    # block behind, so evictions almost always demote instead of dropping).
    ssd_clean_at: float = 0.0
    # A node re-joining (after a master restart) takes no new allocations for
    # this long, so ranges named in leases the old master granted are not reused
    # while clients may still read them (covers the client lease cache's hold).
    rejoin_grace_s: float = 2.0
    # Keyless allocations handed to clients for their next puts expire after this;
    # clients use them for at most half of min(grant_ttl, rejoin_grace_s), and 1 s.
    grant_ttl: float = 5.0
    # Grants held by all clients together stay under this share of the cluster's DRAM.
    grant_share: float = 1 / 16


class Master:
    """The catalog behind RPC; ``start()`` serves in background threads."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.catalog = BlockCatalog(
            policy=config.policy,
            lease_ttl=config.lease_ttl,
            alloc_ttl=config.alloc_ttl,
            replication=config.replication,
            grant_ttl=config.grant_ttl,
        )
        self.regions: dict[str, RegionInfo] = {}
        self._node_clients: dict[str, RpcClient] = {}
        self.metrics = Metrics("master")
        self.metrics.granted.set_function(lambda: self.catalog.granted_bytes)  # read at scrape
        self.metrics_port: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = RpcServer(
            ServerConfig(
                host=config.host, port=config.port, token=config.token, name="kvpool-master"
            )
        )
        self._register_handlers()
        self._reaper = threading.Thread(target=self._reap_loop, name="kvpool-reaper", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    def start(self) -> tuple[str, int]:
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
        self._reaper.start()
        return self._server.start()

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        for node_id in list(self._node_clients):
            self._drop_node_client(node_id)
        self.metrics.close()

    # -- handlers -------------------------------------------------------------

    def _register_handlers(self) -> None:
        routes: list[tuple[str, Any, Any]] = [
            (REGISTER, self._register, RegisterNode),
            (HEARTBEAT, self._heartbeat, Heartbeat),
            (ALLOCATE, self._allocate, AllocateRequest),
            (COMMIT, self._commit, CommitRequest),
            (REVOKE, self._revoke, IdsRequest),
            (LEASE, self._lease, LeaseRequest),
            (RELEASE, self._release, ReleaseRequest),
            (EXISTS, self._exists, KeysRequest),
            (PREFIX, self._prefix_match, KeysRequest),
            (REMOVE, self._remove, KeysRequest),
            (REPLICATE, self._replicate, ReplicateRequest),
            (LOCATE, self._locate, KeysRequest),
            (STATS, self._stats, None),
        ]
        # Handlers are short critical sections under one lock: running them on the
        # connection's reader thread saves a thread hop (~50 us) per call.
        for method, fn, request_type in routes:
            self._server.register(
                method, self.metrics.wrap(method, fn), request_type=request_type, inline=True
            )

    def _register(self, msg: RegisterNode) -> dict[str, Any]:
        region = msg.region
        blocks = [(b[0], b[1], b[2], b[3], b[4]) for b in msg.blocks]
        ssd_blocks = [(b[0], b[1], b[2]) for b in msg.ssd_blocks]
        with self._lock:
            self.catalog.add_node(
                region.node_id,
                region.size,
                region.to_dict(),
                region.host_id,
                has_ssd=region.ssd_bytes > 0,
                grace_s=self.config.rejoin_grace_s if msg.rejoin else 0.0,
            )
            self.regions[region.node_id] = region
            self._drop_node_client(region.node_id)
            restored = self.catalog.restore_blocks(region.node_id, blocks)
            restored += self.catalog.restore_ssd(region.node_id, ssd_blocks)
            self._refresh_gauges()
        log.info(
            "node %s registered: %d bytes, %d blocks restored",
            region.node_id,
            region.size,
            restored,
        )
        return {"restored": restored}

    def _heartbeat(self, msg: Heartbeat) -> HeartbeatReply:
        with self._lock:
            if not self.catalog.touch_node(msg.node_id):
                return HeartbeatReply(known=False)
            for key, checksum in msg.checksums:
                self.catalog.set_checksum(key, checksum)
            node = self.catalog.nodes[msg.node_id]
            events, node.outbox = node.outbox, []
        return HeartbeatReply(known=True, events=[list(e) for e in events])

    def _allocate(self, msg: AllocateRequest) -> AllocateReply:
        if not len(msg.keys) == len(msg.sizes) == len(msg.parents):
            raise ValueError("keys, sizes and parents must have the same length")
        check_keys(msg.keys, msg.parents)
        if any(not isinstance(size, int) or size <= 0 for size in msg.sizes):
            raise ValueError("block sizes must be positive integers")
        if not isinstance(msg.spare, int) or not isinstance(msg.spare_size, int):
            raise ValueError("spare and spare_size must be integers")
        if msg.spare < 0 or (msg.spare and msg.spare_size <= 0):
            raise ValueError("spare must be >= 0, and spare_size > 0 when spare > 0")
        with self._lock:
            grace = self.catalog.grace_left() if not self._usable_nodes() else 0.0
        if grace:  # every node is re-joining: wait for the first to become usable
            time.sleep(grace)
        placements: list[list[list[Any]] | None] = []
        error, full = "", []
        with self._lock:
            evictions = self.catalog.evictions
            for i, (key, size, parent) in enumerate(
                zip(msg.keys, msg.sizes, msg.parents, strict=True)
            ):
                try:
                    allocs = self.catalog.allocate(
                        key, size, parent, max(1, msg.replicas), msg.node_id or None
                    )
                except CatalogFullError as exc:
                    placements.append(None)
                    error = str(exc)
                    full.append(i)
                    continue
                placements.append(
                    None if allocs is None else [[a.alloc_id, a.node_id, a.offset] for a in allocs]
                )
            lend = msg.spare and msg.replicas <= 1 and not msg.node_id and self._grant_window()
            spares = self._grant(msg) if lend else []
            self.metrics.evictions.inc(self.catalog.evictions - evictions)
            nodes = self._regions_of(
                [p[1] for ps in placements if ps for p in ps] + [g[1] for g in spares]
            )
            self._refresh_gauges()
        return AllocateReply(
            placements=placements,
            nodes=nodes,
            error=error,
            full=full,
            ttl=self.config.alloc_ttl,
            spares=spares,
            spare_ttl=self._grant_window(),
        )

    def _grant_window(self) -> float:
        """What clients are told a grant lives (they use it for half of that): never
        past the re-join grace, so a restarted master cannot hand its range to
        another writer while a client still fills it."""
        return min(self.catalog.grant_ttl, self.config.rejoin_grace_s)

    def _grant(self, msg: AllocateRequest) -> list[list[Any]]:
        """Keyless allocations for a client's next puts: all clients' grants together
        hold at most ``grant_share`` of the cluster's DRAM."""
        dram = sum(n.allocator.capacity for n in self.catalog.nodes.values())
        room = int(self.config.grant_share * dram) - self.catalog.granted_bytes
        count = min(msg.spare, MAX_GRANTS, room // msg.spare_size)
        grants = self.catalog.grant(msg.spare_size, count) if count > 0 else []
        return [[g.alloc_id, g.node_id, g.offset] for g in grants]

    def _commit(self, msg: CommitRequest) -> list[bool | None]:
        ids, keys, parents = msg.ids, msg.keys, msg.parents
        if keys and len(keys) != len(ids):
            raise ValueError("commit: keys must be empty or one per id")
        if parents and len(parents) != len(keys):
            raise ValueError("commit: parents must be empty or one per key")
        parents = parents or [None] * len(keys)
        check_keys(
            [k for k in keys if k is not None],
            [p for k, p in zip(keys, parents, strict=True) if k is not None],
        )
        catalog = self.catalog
        done: list[bool | None] = []
        with self._lock:
            for i, alloc_id in enumerate(ids):
                key = keys[i] if keys else None
                if key is None:
                    done.append(catalog.commit(alloc_id) is not None)
                else:
                    done.append(catalog.commit_grant(alloc_id, key, parents[i]))
            self.metrics.blocks.set(len(catalog.blocks))
        return done

    def _revoke(self, msg: IdsRequest) -> None:
        with self._lock:
            for alloc_id in msg.ids:
                self.catalog.revoke(alloc_id)

    def _lease(self, msg: LeaseRequest) -> LeaseReply:
        check_keys(msg.keys)
        with self._lock:
            lease_id, found = self.catalog.lease(msg.keys, prefix=msg.prefix)
            promotions = [
                (b, self.catalog.reserve_promotion(b))
                for b in found
                if b is not None and self.catalog.ssd_only(b)
            ]
        if promotions:
            self._promote(promotions)
        with self._lock:
            blocks: list[list[Any] | None] = []
            for block in found:
                dram = [] if block is None else [r for r in block.replicas if r.tier == "dram"]
                if block is None or not dram:
                    if msg.prefix:
                        break
                    blocks.append(None)
                    continue
                blocks.append([block.size, [[r.node_id, r.offset] for r in dram]])
            index = {b.key: i for i, b in enumerate(found) if b is not None and i < len(blocks)}
            orders = [
                [index[a.key], a.alloc_id, a.node_id, a.offset]
                for a in self.catalog.hot_replicas([found[i] for i in index.values()])
                if a.key is not None  # always: replicas of stored blocks have keys
            ]
            node_ids = [r[0] for b in blocks if b for r in b[1]] + [o[2] for o in orders]
            nodes = self._regions_of(node_ids)
        hits = sum(b is not None for b in blocks)
        self.metrics.hits.inc(hits)
        self.metrics.misses.inc(len(msg.keys) - hits)
        busy = any(alloc is None for _, alloc in promotions)
        return LeaseReply(lease_id, blocks, nodes, self.config.lease_ttl, busy, orders)

    def _promote(self, promotions: list[tuple[BlockMeta, Allocation | None]]) -> None:
        """Load SSD-only blocks (leased by the caller) back into their nodes' DRAM."""
        by_node: dict[str, list[tuple[BlockMeta, Allocation]]] = {}
        for block, alloc in promotions:
            if alloc is not None:
                by_node.setdefault(alloc.node_id, []).append((block, alloc))
        for node_id, items in by_node.items():
            try:
                loaded = self._node_call(node_id, SSD_LOAD, [[b.key, a.offset] for b, a in items])
            except (KVPoolError, OSError) as exc:
                log.warning("node %s could not load from SSD: %s", node_id, exc)
                loaded = [False] * len(items)
            with self._lock:
                for (block, alloc), ok in zip(items, loaded, strict=True):
                    self.catalog.finish_promotion(block, alloc, bool(ok))

    def _replicate(self, msg: ReplicateRequest) -> ReplicateReply:
        check_keys(msg.keys)
        allocations: list[list[Any] | None] = []
        with self._lock:
            for key in msg.keys:
                try:
                    alloc = self.catalog.allocate_replica(key, msg.node_id or None)
                except CatalogFullError:
                    alloc = None
                allocations.append(
                    None if alloc is None else [alloc.alloc_id, alloc.node_id, alloc.offset]
                )
            nodes = self._regions_of(a[1] for a in allocations if a)
        return ReplicateReply(allocations, nodes)

    def _release(self, msg: ReleaseRequest) -> None:
        with self._lock:
            for lease_id in msg.ids:
                self.catalog.release(lease_id)
            for key, reads in msg.reads:
                self.catalog.add_reads(key, reads)

    def _exists(self, msg: KeysRequest) -> list[bool]:
        check_keys(msg.keys)
        with self._lock:
            return self.catalog.exists(msg.keys)

    def _prefix_match(self, msg: KeysRequest) -> int:
        check_keys(msg.keys)
        with self._lock:
            return self.catalog.prefix_match(msg.keys)

    def _locate(self, msg: KeysRequest) -> list[list[str]]:
        check_keys(msg.keys)
        with self._lock:
            return self.catalog.locate(msg.keys)

    def _remove(self, msg: KeysRequest) -> list[bool]:
        check_keys(msg.keys)
        with self._lock:
            removed = [self.catalog.remove(key) for key in msg.keys]
            self._refresh_gauges()
            return removed

    def _stats(self, _params: Any) -> dict[str, Any]:
        with self._lock:
            cat = self.catalog
            return {
                "mode": "distributed",
                "policy": cat.policy_name,
                "blocks": len(cat.blocks),
                "pending_allocations": len(cat.pending),
                "granted_bytes": cat.granted_bytes,
                "leases": len(cat.leases),
                "evictions": cat.evictions,
                "nodes": {
                    node_id: {
                        "capacity_bytes": node.allocator.capacity,
                        "used_bytes": node.allocator.used_bytes,
                        "blocks": len(node.policy) + len(node.extras),
                        "ssd_blocks": len(node.ssd) if node.ssd is not None else None,
                        "host_id": node.host_id,
                    }
                    for node_id, node in cat.nodes.items()
                },
            }

    # -- helpers ----------------------------------------------------------------

    def _usable_nodes(self) -> bool:
        return any(n.usable_at <= self.catalog.clock() for n in self.catalog.nodes.values())

    def _regions_of(self, node_ids: Any) -> dict[str, RegionInfo]:
        return {n: self.regions[n] for n in set(node_ids) if n in self.regions}

    def _refresh_gauges(self) -> None:
        self.metrics.blocks.set(len(self.catalog.blocks))
        self.metrics.nodes.set(len(self.catalog.nodes))

        for node_id, node in self.catalog.nodes.items():
            self.metrics.capacity.labels(node_id).set(node.allocator.capacity)
            self.metrics.used.labels(node_id).set(node.allocator.used_bytes)

    def _node_call(self, node_id: str, method: str, params: Any) -> Any:
        """Call a node's own RPC server (SSD tier commands)."""
        client = self._node_clients.get(node_id)
        if client is None:
            region = self.regions[node_id]
            client = RpcClient(
                (region.tcp_host, region.control_port),
                token=self.config.token,
                timeout=self.config.node_ttl * 4,
                name="kvpool-master",
            )
            self._node_clients[node_id] = client
        return client.call(method, params)

    def _drop_node_client(self, node_id: str) -> None:
        client = self._node_clients.pop(node_id, None)
        if client is not None:
            client.close()

    def _clean_to_ssd(self) -> None:
        """Copy the oldest DRAM-only blocks of SSD nodes (past ``ssd_clean_at`` fill) to
        their SSD tier, so that evicting them later demotes instead of dropping."""
        for node_id in [n for n, r in list(self.regions.items()) if r.ssd_bytes]:
            with self._lock:
                node = self.catalog.nodes.get(node_id)
                full = self.config.ssd_clean_at * (node.allocator.capacity if node else 0)
                if node is None or not node.dirty or node.allocator.used_bytes < full:
                    continue
                picked = self.catalog.pick_for_ssd(node_id, SSD_CLEAN_BATCH)
                items = [
                    [b.key, self.catalog.dram_offset(b, node_id), b.size, b.parent] for b in picked
                ]
            if not picked:
                continue
            stored: list[bytes] = []
            dropped: list[bytes] = []
            try:
                reply = self._node_call(node_id, SSD_STORE, items)
                stored, dropped = reply["stored"], reply["dropped"]
            except (KVPoolError, OSError) as exc:
                log.warning("node %s could not write to SSD: %s", node_id, exc)
            with self._lock:
                self.catalog.ssd_stored(node_id, picked, stored, dropped)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.config.reap_interval):
            self._clean_to_ssd()
            with self._lock:
                self.catalog.expire()
                self.catalog.cool_down()
                for node_id in self.catalog.dead_nodes(self.config.node_ttl):
                    lost = self.catalog.remove_node(node_id)
                    self.regions.pop(node_id, None)
                    self._drop_node_client(node_id)
                    self.metrics.capacity.remove(node_id)
                    self.metrics.used.remove(node_id)
                    log.warning(
                        "node %s missed heartbeats for %.1f s: dropped (%d blocks lost)",
                        node_id,
                        self.config.node_ttl,
                        len(lost),
                    )
                self._refresh_gauges()
