"""The SSD tier as the catalog sees it: write-behind copies, demotion, promotion.

A node with an SSD tier keeps SSD copies of its coldest DRAM blocks, written
ahead by the master's cleaner (``pick_for_ssd`` then ``ssd_stored``).
Invariants:
- only DRAM replicas are tracked by the eviction policies; the node evicts
  its own SSD and reports what it dropped;
- evicting a DRAM replica that has an SSD copy leaves an SSD-only replica
  (CatalogState.make_room), which a read promotes back to DRAM
  (``reserve_promotion`` then ``finish_promotion``) before anyone is told
  where to read;
- blocks picked for SSD are pinned (like a lease) until ``ssd_stored``, so
  their bytes stay put while the node copies them;
- ``node.dirty`` lists a node's DRAM-only blocks, oldest first: the order
  the cleaner copies them in.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.index.catalog.events import BlockCommitted, RangeFreed, SsdCopyDropped
from kvpool.index.catalog.records import Allocation, BlockMeta, Replica
from kvpool.index.catalog.state import CatalogState


class SsdTier:
    """SSD copies, demotions and promotions over one catalog's state."""

    def __init__(self, state: CatalogState) -> None:
        self.state = state

    def restore(self, node_id: str, blocks: Sequence[tuple[bytes, int, bytes | None]]) -> int:
        """Re-admit the (key, size, parent) blocks a node keeps on its SSD."""
        state = self.state
        node = state.nodes[node_id]
        if node.ssd is None:
            return 0
        for key, size, parent in blocks:
            node.ssd[key] = size
            node.dirty.pop(key, None)
            block = state.blocks.get(key)
            if block is None or all(r.node_id != node_id for r in block.replicas):
                replica = Replica(node_id, -1, size, tier="ssd")
                state.add_replica(key, size, parent, replica, tell_node=False)
        return len(blocks)

    def pick_for_ssd(self, node_id: str, max_bytes: int) -> list[BlockMeta]:
        """The oldest DRAM-only blocks of a node to copy to its SSD, pinned until
        ``ssd_stored`` (so their bytes stay put while the node writes them)."""
        state = self.state
        node = state.nodes[node_id]
        picked: list[BlockMeta] = []
        total = 0
        for key in list(node.dirty):
            block = state.blocks.get(key)
            if block is None:
                del node.dirty[key]
                continue
            if total + block.size > max_bytes and picked:
                break
            block.leases += 1
            picked.append(block)
            total += block.size
        return picked

    def dram_offset(self, block: BlockMeta, node_id: str) -> int:
        return next(r.offset for r in block.replicas if r.node_id == node_id and r.tier == "dram")

    def ssd_stored(
        self,
        node_id: str,
        picked: Sequence[BlockMeta],
        stored: Sequence[bytes],
        dropped: Sequence[bytes],
    ) -> None:
        """The node wrote ``stored`` to its SSD and evicted ``dropped`` from it."""
        state = self.state
        for block in picked:
            state.unpin(block)
        node = state.nodes.get(node_id)
        if node is None or node.ssd is None:
            return
        for key in stored:
            meta = state.blocks.get(key)
            if meta is None:
                node.events.append(SsdCopyDropped(key))  # removed while it was written
                continue
            node.ssd[key] = meta.size
            node.dirty.pop(key, None)
        for key in dropped:
            state.forget_ssd_copy(node, key)

    @staticmethod
    def ssd_only(block: BlockMeta) -> bool:
        return not any(r.tier == "dram" for r in block.replicas)

    def reserve_promotion(self, block: BlockMeta) -> Allocation | None:
        """DRAM room for an SSD-only block on a node holding its SSD copy."""
        state = self.state
        for replica in block.replicas:
            node = state.nodes[replica.node_id]
            offset = state.make_room(node, block.size)
            if offset is not None:
                return Allocation(
                    state.new_id(),
                    block.key,
                    node.node_id,
                    offset,
                    block.size,
                    block.parent,
                    state.clock() + state.alloc_ttl,
                )
        return None

    def finish_promotion(self, block: BlockMeta, alloc: Allocation, ok: bool) -> None:
        """The node loaded (``ok``) or failed to load the block into ``alloc``'s range.
        A load the catalog no longer wants is freed, and the node told to drop it."""
        state = self.state
        node = state.nodes.get(alloc.node_id)
        if node is None:
            return
        replica = next((r for r in block.replicas if r.node_id == alloc.node_id), None)
        if not ok or replica is None or block.removed or replica.tier != "ssd":
            node.allocator.free(alloc.offset)
            if not ok:
                state.forget_ssd_copy(node, block.key)
            else:  # loaded, but not wanted now (removed, or promoted by another read)
                node.events.append(RangeFreed(alloc.offset, alloc.alloc_id))
            return
        replica.tier, replica.offset, replica.alloc_id = "dram", alloc.offset, alloc.alloc_id
        state.policy_of(replica).on_insert(block.key, block.parent)
        node.events.append(
            BlockCommitted(block.key, alloc.offset, block.size, block.parent, alloc.alloc_id)
        )
