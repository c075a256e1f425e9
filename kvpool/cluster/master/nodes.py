"""Node membership: registration, heartbeats, dead nodes, and the master's calls to nodes.

A node registers with the blocks it holds (after a master restart this
rebuilds the catalog), then heartbeats; each heartbeat reply carries what
the node must learn about its region since the last one (the catalog's
typed events, turned into their wire form here and nowhere else). A node
silent for ``node_ttl`` is dropped with its replicas. Nodes with an SSD tier
get the oldest DRAM-only blocks copied ahead of eviction (``clean_to_ssd``).
"""

from __future__ import annotations

import logging
from typing import Any

from kvpool.cluster.master.config import SSD_CLEAN_BATCH
from kvpool.cluster.master.state import MasterState
from kvpool.cluster.wire import (
    EVENT_COMMIT,
    EVENT_FREE,
    EVENT_SSD_DROP,
    SSD_STORE,
    Heartbeat,
    HeartbeatReply,
    RegisterNode,
)
from kvpool.errors import KVPoolError, StaleEpochError
from kvpool.index.catalog import BlockCommitted, NodeEvent, RangeFreed, SsdCopyDropped
from kvpool.rpc.client import RpcClient

log = logging.getLogger("kvpool.cluster.master")


def event_wire(event: NodeEvent) -> list[Any]:
    """A catalog event as a heartbeat reply carries it (see kvpool.cluster.node)."""
    match event:
        case BlockCommitted(key, offset, size, parent, alloc_id):
            return [EVENT_COMMIT, key, offset, size, parent, alloc_id]
        case RangeFreed(offset, alloc_id):
            return [EVENT_FREE, offset, alloc_id]
        case SsdCopyDropped(key):
            return [EVENT_SSD_DROP, key]
    raise TypeError(f"not a node event: {event!r}")


class NodeLinks:
    """One RPC client per node, made on first use (the master calls nodes' SSD tier)."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        self._clients: dict[str, RpcClient] = {}

    def call(self, node_id: str, method: str, params: Any) -> Any:
        """Call a node's own RPC server (SSD tier commands), stamped with this
        master's term: a node serving a newer term refuses it."""
        client = self._clients.get(node_id)
        if client is None:
            region = self.state.regions[node_id]
            config = self.state.config
            client = RpcClient(
                (region.tcp_host, region.control_port),
                token=config.token,
                timeout=config.node_ttl * 4,
                name="kvpool-master",
            )
            self._clients[node_id] = client
        return client.call(method, {"epoch": self.state.epoch, "items": params})

    def drop(self, node_id: str) -> None:
        client = self._clients.pop(node_id, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for node_id in list(self._clients):
            self.drop(node_id)


class NodeMembership:
    """The ``node.*`` handlers and the reaper's per-node work."""

    def __init__(self, state: MasterState, links: NodeLinks) -> None:
        self.state, self.links = state, links

    def register(self, msg: RegisterNode) -> dict[str, Any]:
        state, region = self.state, msg.region
        if msg.epoch > state.epoch:
            raise StaleEpochError(
                f"node {region.node_id} serves master term {msg.epoch}, newer than this "
                f"master's {state.epoch}: another master leads this cluster"
            )
        # [key, offset, size, checksum, parent, confirmed]; nodes of older releases
        # send no ``confirmed``: taken as confirmed (their blocks were all restored).
        blocks = [
            (b[0], b[1], b[2], b[3], b[4], bool(b[5]) if len(b) > 5 else True) for b in msg.blocks
        ]
        ssd_blocks = [(b[0], b[1], b[2]) for b in msg.ssd_blocks]
        with state.lock:
            state.catalog.add_node(
                region.node_id,
                region.size,
                region.to_dict(),
                region.host_id,
                has_ssd=region.ssd_bytes > 0,
            )
            state.regions[region.node_id] = region
            self.links.drop(region.node_id)
            refused = state.catalog.restore_blocks(region.node_id, blocks)
            restored = len(blocks) - len(refused)
            if msg.rejoin:
                # Readers may still copy these under the previous term's leases: keep
                # them (not the node's free space: allocations go on at once).
                state.catalog.pin([b[0] for b in blocks], state.config.rejoin_grace_s)
            restored += state.catalog.ssd_tier.restore(region.node_id, ssd_blocks)
            state.track_nodes()
            epoch = state.epoch  # the term this node joined (a later one swaps the catalog)
        log.info(
            "node %s registered: %d bytes, %d blocks restored",
            region.node_id,
            region.size,
            restored,
        )
        return {"restored": restored, "epoch": epoch, "refused": refused}

    def regions(self, _params: Any) -> dict[str, dict[str, Any]]:
        """Every registered node's region, as it registered it (a client maps or
        connects to its nodes ahead of its first call: kvpool.cluster.client.warm_up)."""
        with self.state.lock:
            return {node_id: region.to_dict() for node_id, region in self.state.regions.items()}

    def heartbeat(self, msg: Heartbeat) -> HeartbeatReply:
        with self.state.lock:  # the catalog and epoch of one term (a new term swaps both)
            catalog, epoch = self.state.catalog, self.state.epoch
            stale = msg.epoch and msg.epoch != epoch  # 0: a node that does not say
            if stale or not catalog.touch_node(msg.node_id):
                return HeartbeatReply(known=False, epoch=epoch)
            for key, checksum in msg.checksums:
                catalog.set_checksum(key, checksum)
            events = catalog.drain_events(msg.node_id)
        return HeartbeatReply(known=True, events=[event_wire(e) for e in events], epoch=epoch)

    def drop_dead_nodes(self) -> None:
        """Forget nodes whose heartbeats stopped for ``node_ttl`` (call under the lock)."""
        state = self.state
        for node_id in state.catalog.dead_nodes(state.config.node_ttl):
            lost = state.catalog.remove_node(node_id)
            state.regions.pop(node_id, None)
            self.links.drop(node_id)
            log.warning(
                "node %s missed heartbeats for %.1f s: dropped (%d blocks lost)",
                node_id,
                state.config.node_ttl,
                len(lost),
            )

    def clean_to_ssd(self) -> None:
        """Copy the oldest DRAM-only blocks of SSD nodes (past ``ssd_clean_at`` fill) to
        their SSD tier, so that evicting them later demotes instead of dropping."""
        state, ssd_tier = self.state, self.state.catalog.ssd_tier
        for node_id in [n for n, r in list(state.regions.items()) if r.ssd_bytes]:
            with state.lock:
                node = state.catalog.nodes.get(node_id)
                full = state.config.ssd_clean_at * (node.allocator.capacity if node else 0)
                if node is None or not node.dirty or node.allocator.used_bytes < full:
                    continue
                picked = ssd_tier.pick_for_ssd(node_id, SSD_CLEAN_BATCH)
                items = [
                    [b.key, ssd_tier.dram_offset(b, node_id), b.size, b.parent] for b in picked
                ]
            if not picked:
                continue
            stored: list[bytes] = []
            dropped: list[bytes] = []
            try:
                reply = self.links.call(node_id, SSD_STORE, items)
                stored, dropped = reply["stored"], reply["dropped"]
            except (KVPoolError, OSError) as exc:
                log.warning("node %s could not write to SSD: %s", node_id, exc)
            with state.lock:
                ssd_tier.ssd_stored(node_id, picked, stored, dropped)
