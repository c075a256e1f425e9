"""Read heat and extra replicas: hot blocks gain replicas, cooled blocks lose them.

Replicas are primary (placed by a put) or extra (added for read load, under
the rule in kvpool.index.heat). Invariants:
- a block has at most ``max_replicas`` replicas (and never two on one node),
  and at most one extra replica in flight at a time;
- each node evicts extras before primaries, and a block whose primaries all
  left keeps an extra as its new primary (CatalogState.after_replica_loss);
- extras of a leased block are not dropped by ``cool_down`` (a reader may be
  copying them);
- reads are routed to the least loaded replica, DRAM before SSD: the one a
  lease lists first.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.index.catalog.records import Allocation, BlockMeta, CatalogFullError, NodeSpace
from kvpool.index.catalog.state import CatalogState
from kvpool.index.heat import ReplicationConfig, decayed


class Replication:
    """Heat accounting and extra-replica placement over one catalog's state."""

    def __init__(self, state: CatalogState, config: ReplicationConfig) -> None:
        self.state, self.config = state, config

    def count_read(self, block: BlockMeta) -> None:
        """Heat the block, refresh its replicas' recency, route the read to the least
        loaded replica (listed first)."""
        state = self.state
        now, half_life = state.clock(), self.config.half_life_s
        block.heat = decayed(block.heat, block.heat_at, now, half_life) + 1.0
        block.heat_at = now
        for replica in block.replicas:
            if replica.tier == "dram":
                state.policy_of(replica).on_access(block.key)
        if len(block.replicas) > 1:  # DRAM first, then the least loaded node
            block.replicas.sort(
                key=lambda r: (r.tier != "dram", self._load(state.nodes[r.node_id], now))
            )
        node = state.nodes[block.replicas[0].node_id]
        node.load = self._load(node, now) + 1.0
        node.load_at = now

    def _load(self, node: NodeSpace, now: float) -> float:
        return decayed(node.load, node.load_at, now, self.config.half_life_s)

    def add_reads(self, key: bytes, reads: int) -> None:
        """Reads a client served from its lease cache, for the heat accounting."""
        block = self.state.blocks.get(key)
        if block is not None and isinstance(reads, int) and reads > 0:
            now = self.state.clock()
            block.heat = decayed(block.heat, block.heat_at, now, self.config.half_life_s) + reads
            block.heat_at = now

    def allocate_replica(self, key: bytes, node_id: str | None = None) -> Allocation | None:
        """Room for one extra replica of a stored block, on ``node_id`` or the emptiest
        node not holding it. None if the block is missing, already on that node, or
        has a replica in flight; CatalogFullError if the node has no room."""
        state = self.state
        block = state.blocks.get(key)
        if block is None or key in state.keys_in_flight:
            return None
        holders = {r.node_id for r in block.replicas}
        candidates = [
            n for n in state.nodes_by_free_space(only=node_id) if n.node_id not in holders
        ]
        for node in candidates:
            offset = state.make_room(node, block.size)
            if offset is not None:
                return state.pend(key, node, offset, block.size, block.parent, extra=True)
        if candidates:
            raise CatalogFullError(f"no room for a replica of {block.size} bytes")
        return None

    def hot_replicas(self, blocks: Sequence[BlockMeta | None]) -> list[Allocation]:
        """Extra-replica allocations for the hot blocks among ``blocks`` (just read).

        The reader that holds the bytes fills them (or revokes); see ReplicationConfig.
        """
        config = self.config
        orders = []
        for block in blocks:
            if (
                block is None
                or not config.enabled
                or block.heat < config.hot_reads
                or len(block.replicas) >= min(config.max_replicas, len(self.state.nodes))
            ):
                continue
            try:
                alloc = self.allocate_replica(block.key)
            except CatalogFullError:
                continue
            if alloc is not None:
                orders.append(alloc)
        return orders

    def cool_down(self) -> int:
        """Drop the extra replicas of blocks whose heat fell below ``cool_reads``."""
        state = self.state
        now, config, dropped = state.clock(), self.config, 0
        for key in list(state.with_extras):
            block = state.blocks.get(key)
            if block is None:
                state.with_extras.discard(key)
                continue
            if decayed(block.heat, block.heat_at, now, config.half_life_s) >= config.cool_reads:
                continue
            if block.leases:
                continue
            for replica in [r for r in block.replicas if not r.primary]:
                node = state.nodes[replica.node_id]
                node.extras.on_remove(key)
                block.replicas.remove(replica)
                state.free_replica(node, replica)
                dropped += 1
            state.with_extras.discard(key)
        return dropped
