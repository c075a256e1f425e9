"""The catalog's core state and the steps that keep its space accounting exact.

``CatalogState`` holds every record (nodes, blocks, allocations in flight,
leases) and the few primitive steps the catalog's parts share: carving room
on a node (evicting as needed), adding and dropping replicas, recording and
forgetting allocations, and queuing the node events each change implies.
kvpool.index.catalog.block_catalog builds the public operations on top;
kvpool.index.catalog.replication and kvpool.index.catalog.ssd use the same
steps for extra replicas and the SSD tier.

Invariants every step keeps:
- a node's allocator holds exactly: its DRAM replicas of stored blocks, its
  DRAM replicas of removed blocks still leased (once each, however many
  leases hold them), and its allocations in flight;
- each DRAM replica is tracked by exactly one of its node's policies
  (``policy`` for primaries, ``extras`` for extra replicas); SSD-only
  replicas by none;
- every range freed on a node queues a ``RangeFreed`` for it, every replica
  made visible a ``BlockCommitted`` (except blocks the node itself reported);
- ``granted_bytes`` is the sum of the sizes of pending keyless allocations.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvpool.eviction import EvictionPolicy, make_policy
from kvpool.index.catalog.events import BlockCommitted, NodeEvent, RangeFreed, SsdCopyDropped
from kvpool.index.catalog.records import Allocation, BlockMeta, LeaseRecord, NodeSpace, Replica

#: Commits remembered to answer a late second commit of an allocation (``committed_before``).
COMMITTED_MEMORY = 1 << 16


class CatalogState:
    """Records of the whole cluster and the primitive steps on them (no public API)."""

    def __init__(
        self,
        policy: str,
        alignment: int,
        alloc_ttl: float,
        lease_ttl: float,
        grant_ttl: float,
        clock: Callable[[], float],
    ) -> None:
        make_policy(policy)  # fail early on an unknown policy name
        self.policy_name, self.alignment = policy, alignment
        self.alloc_ttl, self.lease_ttl, self.clock = alloc_ttl, lease_ttl, clock
        self.grant_ttl = min(grant_ttl, alloc_ttl)
        self.nodes: dict[str, NodeSpace] = {}
        self.blocks: dict[bytes, BlockMeta] = {}
        self.pending: dict[int, Allocation] = {}
        self.leases: dict[int, LeaseRecord] = {}
        self.keys_in_flight: dict[bytes, int] = {}  # key -> allocations in flight (not superseded)
        self.granted_bytes = 0  # space held by grants (pending allocations with no key)
        self.with_extras: set[bytes] = set()  # blocks that have extra replicas
        self.committed: OrderedDict[int, bytes] = OrderedDict()  # alloc id -> key, newest last
        self.evictions = 0
        # Allocation and lease ids start at a random point: ids a client still
        # holds from a previous master (across a restart) never name this one's.
        self._ids = itertools.count(1 + secrets.randbits(52))

    def new_id(self) -> int:
        """A fresh allocation or lease id (never 0, never reused)."""
        return next(self._ids)

    def drain_events(self, node_id: str) -> list[NodeEvent]:
        """What ``node_id`` must learn about its region since the last drain, in order.

        Each event is handed out once; an unknown node has none.
        """
        node = self.nodes.get(node_id)
        if node is None:
            return []
        events, node.events = node.events, []
        return events

    # -- room -------------------------------------------------------------------

    def make_room(self, node: NodeSpace, size: int) -> int | None:
        """An offset for ``size`` bytes on ``node``, evicting unleased replicas (extras
        first) as needed; None if even that cannot make room."""
        if node.allocator.round_up(size) > node.allocator.capacity:
            return None
        while True:
            offset = node.allocator.allocate(size)
            if offset is not None:
                return offset
            victim = node.extras.victim(self._evictable) or node.policy.victim(self._evictable)
            if victim is None:
                return None
            self._evict_replica(node, victim)

    def nodes_by_free_space(self, only: str | None = None) -> list[NodeSpace]:
        """Usable nodes (past their re-join grace), most free space first (or only ``only``)."""
        now = self.clock()
        usable = [n for n in self.nodes.values() if n.usable_at <= now]
        if only is not None:
            return [n for n in usable if n.node_id == only]
        # Most free space first; on ties, the node with most extra replicas,
        # which it can drop without losing a block.
        return sorted(usable, key=lambda n: (-n.allocator.free_bytes, -len(n.extras)))

    def place(
        self,
        key: bytes,
        size: int,
        parent: bytes | None,
        nodes: Sequence[NodeSpace],
        replicas: int,
    ) -> list[Allocation]:
        """Up to ``replicas`` allocations of ``key``, one per node, in ``nodes``' order."""
        placed: list[Allocation] = []
        for node in nodes:
            if len(placed) == replicas:
                break
            offset = self.make_room(node, size)
            if offset is not None:
                placed.append(self.pend(key, node, offset, size, parent))
        return placed

    def _evictable(self, key: bytes) -> bool:
        block = self.blocks.get(key)
        return block is not None and block.leases == 0

    def _evict_replica(self, node: NodeSpace, key: bytes) -> None:
        """Drop ``key``'s DRAM replica on ``node`` (already untracked by its policy);
        it stays on the node as an SSD-only replica when the SSD holds a copy."""
        block = self.blocks[key]
        self.evictions += 1
        if node.ssd is not None and key in node.ssd:
            for replica in block.replicas:
                if replica.node_id == node.node_id and replica.tier == "dram":
                    self.free_replica(node, replica)
                    replica.tier, replica.offset, replica.alloc_id = "ssd", -1, 0
                    if not replica.primary:  # extras do not linger on SSD
                        self.forget_ssd_copy(node, key, tell_node=True)
            return
        node.dirty.pop(key, None)
        mine = [r for r in block.replicas if r.node_id == node.node_id]
        block.replicas = [r for r in block.replicas if r.node_id != node.node_id]
        for replica in mine:
            self.free_replica(node, replica)
        self.after_replica_loss(block)

    # -- allocations in flight ----------------------------------------------------

    def pend(
        self,
        key: bytes | None,
        node: NodeSpace,
        offset: int,
        size: int,
        parent: bytes | None,
        extra: bool = False,
        ttl: float | None = None,
    ) -> Allocation:
        """Record an allocation in flight (invisible until commit, expires otherwise)."""
        deadline = self.clock() + (self.alloc_ttl if ttl is None else ttl)
        alloc = Allocation(self.new_id(), key, node.node_id, offset, size, parent, deadline, extra)
        self.pending[alloc.alloc_id] = alloc
        if key is not None:
            self.keys_in_flight[key] = self.keys_in_flight.get(key, 0) + 1
        else:
            self.granted_bytes += size
        return alloc

    def supersede(self, key: bytes) -> None:
        """Every allocation in flight for ``key`` can no longer become its block
        (another put of it is being committed): each stays pending, its range
        held until its writer commits (the commit frees it) or it expires, but
        it stops counting in ``keys_in_flight``."""
        if self.keys_in_flight.pop(key, None) is None:
            return
        for alloc in self.pending.values():
            if alloc.key == key:
                alloc.superseded = True

    def forget_pending(self, alloc_id: int, free: bool = True) -> Allocation | None:
        """Stop tracking an allocation (freeing its range unless ``free`` is False).

        Returns it, or None if there was none or its node left (its range went
        with the node).
        """
        alloc = self.pending.pop(alloc_id, None)
        if alloc is None:
            return None
        if alloc.key is None:
            self.granted_bytes -= alloc.size
        elif not alloc.superseded:  # a superseded one left keys_in_flight already
            count = self.keys_in_flight[alloc.key] - 1
            if count:
                self.keys_in_flight[alloc.key] = count
            else:
                del self.keys_in_flight[alloc.key]
        node = self.nodes.get(alloc.node_id)
        if free and node is not None:
            node.allocator.free(alloc.offset)
        return None if node is None else alloc

    # -- replicas -------------------------------------------------------------------

    def add_replica(
        self,
        key: bytes,
        size: int,
        parent: bytes | None,
        replica: Replica,
        checksum: int | None = None,
        tell_node: bool = True,
    ) -> None:
        """Make ``replica`` of ``key`` visible (creating the block on its first replica)."""
        block = self.blocks.get(key)
        if block is None:
            block = self.blocks[key] = BlockMeta(key, size, parent, checksum=checksum)
        block.replicas.append(replica)
        if replica.alloc_id:
            self.committed[replica.alloc_id] = key
            if len(self.committed) > COMMITTED_MEMORY:
                self.committed.popitem(last=False)
        node = self.nodes[replica.node_id]
        if replica.tier == "ssd":
            return
        self.policy_of(replica).on_insert(key, parent)
        if node.ssd is not None and key not in node.ssd:
            node.dirty[key] = None
        if not replica.primary:
            self.with_extras.add(key)
        if tell_node:
            node.events.append(BlockCommitted(key, replica.offset, size, parent, replica.alloc_id))

    def committed_before(self, alloc_id: int, key: bytes | None = None) -> bool:
        """Whether ``alloc_id`` was committed in this term (for ``key``, if given), among
        the last ``COMMITTED_MEMORY`` commits. Why: a node commits a sealed block on its
        writer's behalf when no commit confirmed it in time (kvpool.cluster.unconfirmed);
        the writer's own commit, arriving later, found no such allocation -- and when the
        block had been evicted meanwhile, the writer could not find or read it back and
        reported an acknowledged put as lost (a false ``PutCommitError``)."""
        got = self.committed.get(alloc_id)
        return got is not None and (key is None or got == key)

    def policy_of(self, replica: Replica) -> EvictionPolicy:
        node = self.nodes[replica.node_id]
        return node.policy if replica.primary else node.extras

    def free_replica(self, node: NodeSpace, replica: Replica) -> None:
        """Give a DRAM replica's range back to ``node`` (and tell the node)."""
        node.allocator.free(replica.offset)
        node.events.append(RangeFreed(replica.offset, replica.alloc_id))

    def after_replica_loss(self, block: BlockMeta) -> bool:
        """A block just lost replicas: forget it if none is left, else make sure one is
        primary. Returns whether the block is still stored."""
        if not block.replicas:
            del self.blocks[block.key]
            self.with_extras.discard(block.key)
            block.removed = True
            return False
        if not any(r.primary for r in block.replicas):
            self._make_primary(block, block.replicas[0])
        return True

    def _make_primary(self, block: BlockMeta, replica: Replica) -> None:
        node = self.nodes[replica.node_id]
        replica.primary = True
        if replica.tier == "dram":
            node.extras.on_remove(block.key)
            node.policy.on_insert(block.key, block.parent)

    def forget_ssd_copy(self, node: NodeSpace, key: bytes, tell_node: bool = False) -> None:
        """The node no longer has ``key`` on SSD: an SSD-only replica there is gone.

        ``tell_node``: the catalog decided it (the node must drop its copy).
        """
        assert node.ssd is not None
        node.ssd.pop(key, None)
        if tell_node:
            node.events.append(SsdCopyDropped(key))
        block = self.blocks.get(key)
        if block is None:
            return
        block.replicas = [
            r for r in block.replicas if not (r.node_id == node.node_id and r.tier == "ssd")
        ]
        self.after_replica_loss(block)

    # -- pins -----------------------------------------------------------------------

    def unpin(self, block: BlockMeta) -> None:
        """One holder of ``block`` is done; a removed block's extents go with the last."""
        block.leases -= 1
        if block.removed and block.leases == 0:
            self.free_extents(block)

    def free_extents(self, block: BlockMeta) -> None:
        """Free every DRAM range of a block that left the catalog (exactly once)."""
        for replica in block.replicas:
            node = self.nodes.get(replica.node_id)
            if node is not None and replica.tier == "dram":
                self.free_replica(node, replica)
        block.replicas = []
