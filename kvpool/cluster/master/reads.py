"""The ``get.*`` and ``keys.*`` handlers, and ``stats``: leases, look-ups, removal.

A lease pins blocks while a client copies them straight from the nodes; it
never names a block whose bytes are only on SSD: such blocks are first
promoted into DRAM (the node loads them) and a block that cannot be (no
room: everything evictable is leased) is reported as a miss with
``busy=True``. Leases of hot blocks also carry orders for extra replicas
that the reader fills (kvpool.index.catalog.replication).
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.args import check_keys
from kvpool.cluster.master.nodes import NodeLinks
from kvpool.cluster.master.state import MasterState
from kvpool.cluster.wire import (
    SSD_LOAD,
    KeysRequest,
    LeaseReply,
    LeaseRequest,
    ReleaseRequest,
    ReplicateReply,
    ReplicateRequest,
)
from kvpool.errors import KVPoolError
from kvpool.index.catalog import Allocation, BlockMeta, CatalogFullError
from kvpool.rpc.server import Deferred

log = logging.getLogger("kvpool.cluster.master")


class ReadHandlers:
    def __init__(self, state: MasterState, links: NodeLinks) -> None:
        self.state, self.links = state, links

    def lease(self, msg: LeaseRequest) -> LeaseReply | Deferred:
        check_keys(msg.keys)
        state = self.state
        with state.lock:
            catalog = state.catalog  # this term's (read under the lock: terms swap it)
            ssd_tier = catalog.ssd_tier
            lease_id, found = catalog.lease(msg.keys, prefix=msg.prefix)
            promotions = [
                (b, ssd_tier.reserve_promotion(b))
                for b in found
                if b is not None and ssd_tier.ssd_only(b)
            ]
        if promotions:  # node I/O: finish on a worker, never on the connection's reader

            def promote_then_reply() -> LeaseReply:
                self._promote(promotions)
                return self._lease_reply(msg, lease_id, found, promotions)

            return Deferred(promote_then_reply)
        return self._lease_reply(msg, lease_id, found, promotions)

    def _lease_reply(
        self,
        msg: LeaseRequest,
        lease_id: int,
        found: list[BlockMeta | None],
        promotions: list[tuple[BlockMeta, Allocation | None]],
    ) -> LeaseReply:
        state, catalog = self.state, self.state.catalog
        with state.lock:
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
                for a in catalog.replication.hot_replicas([found[i] for i in index.values()])
                if a.key is not None  # always: replicas of stored blocks have keys
            ]
            node_ids = [r[0] for b in blocks if b for r in b[1]] + [o[2] for o in orders]
            nodes = state.regions_of(node_ids)
        hits = sum(b is not None for b in blocks)
        state.metrics.hits.inc(hits)
        state.metrics.misses.inc(len(msg.keys) - hits)
        busy = any(alloc is None for _, alloc in promotions)
        return LeaseReply(
            lease_id, blocks, nodes, state.config.lease_ttl, busy, orders, state.epoch
        )

    def _promote(self, promotions: list[tuple[BlockMeta, Allocation | None]]) -> None:
        """Load SSD-only blocks (leased by the caller) back into their nodes' DRAM."""
        by_node: dict[str, list[tuple[BlockMeta, Allocation]]] = {}
        for block, alloc in promotions:
            if alloc is not None:
                by_node.setdefault(alloc.node_id, []).append((block, alloc))
        for node_id, items in by_node.items():
            try:
                wanted = [[b.key, a.offset, a.alloc_id] for b, a in items]
                loaded = self.links.call(node_id, SSD_LOAD, wanted)
            except (KVPoolError, OSError) as exc:
                log.warning("node %s could not load from SSD: %s", node_id, exc)
                loaded = [False] * len(items)
            with self.state.lock:
                for (block, alloc), ok in zip(items, loaded, strict=True):
                    self.state.catalog.ssd_tier.finish_promotion(block, alloc, bool(ok))

    def replicate(self, msg: ReplicateRequest) -> ReplicateReply:
        check_keys(msg.keys)
        state = self.state
        allocations: list[list[Any] | None] = []
        with state.lock:
            for key in msg.keys:
                try:
                    alloc = state.catalog.replication.allocate_replica(key, msg.node_id or None)
                except CatalogFullError:
                    alloc = None
                allocations.append(
                    None if alloc is None else [alloc.alloc_id, alloc.node_id, alloc.offset]
                )
            nodes = state.regions_of(a[1] for a in allocations if a)
        return ReplicateReply(allocations, nodes, state.epoch)

    def release(self, msg: ReleaseRequest) -> None:
        with self.state.lock:
            catalog = self.state.catalog  # this term's (read under the lock: terms swap it)
            for lease_id in msg.ids:
                catalog.release(lease_id)
            for key, reads in msg.reads:
                catalog.replication.add_reads(key, reads)

    def exists(self, msg: KeysRequest) -> list[bool]:
        check_keys(msg.keys)
        with self.state.lock:
            return self.state.catalog.exists(msg.keys)

    def prefix_match(self, msg: KeysRequest) -> int:
        check_keys(msg.keys)
        with self.state.lock:
            return self.state.catalog.prefix_match(msg.keys)

    def locate(self, msg: KeysRequest) -> list[list[str]]:
        check_keys(msg.keys)
        with self.state.lock:
            return self.state.catalog.locate(msg.keys)

    def remove(self, msg: KeysRequest) -> list[bool]:
        check_keys(msg.keys)
        with self.state.lock:
            return [self.state.catalog.remove(key) for key in msg.keys]

    def stats(self, _params: Any) -> dict[str, Any]:
        with self.state.lock:
            cat = self.state.catalog
            return {
                "mode": "distributed",
                "epoch": self.state.epoch,
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
                        # commits and frees its next heartbeat reply carries
                        "events_queued": len(node.events),
                    }
                    for node_id, node in cat.nodes.items()
                },
            }
