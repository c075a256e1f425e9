"""The cluster's block catalog: which node holds which block, where, and who may free it.

Pure bookkeeping, no I/O: the master wraps it with RPC and timers, tests
drive it directly with a fake clock. Each node contributes one memory region
whose space is carved here by an ExtentAllocator (so puts are allocated on
the master) and ordered for eviction by one policy per node.

Invariants:
- a key is visible (``exists``/``prefix_match``/``lease``) only once at
  least one of its replicas committed; allocations are invisible and expire
  after ``alloc_ttl`` (a client that died mid-put loses nothing but time);
- a *grant* is an allocation with no key yet (``grant``): space a client may
  fill and then bind to a key at commit (``commit_grant``), so a put costs
  one master round trip instead of two. Grants expire after ``grant_ttl``
  (shorter than ``alloc_ttl``); binding a key that is already stored or in
  flight frees the grant's space instead;
- every committed replica's extent is allocated in its node's allocator and
  tracked by that node's policy; a block with no replicas leaves the catalog;
- a leased block (a reader is copying it) is never evicted; ``remove`` of a
  leased block hides it at once and frees its extents once, when the last
  lease holding it ends or expires (``lease_ttl``), however many leases hold
  it, so a slow reader never reads reused bytes while its lease holds;
- a node that leaves (death, restart) takes all its replicas and pending
  allocations with it, hidden (removed but leased) ones included;
- replicas are primary or extra (kvpool.index.catalog.replication); a node
  with an SSD tier keeps SSD copies of its coldest DRAM blocks
  (kvpool.index.catalog.ssd);
- what a node must learn about its region is queued as typed events
  (kvpool.index.catalog.events) and handed out by ``drain_events``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from kvpool.eviction import make_policy
from kvpool.index.catalog.events import RangeFreed, SsdCopyDropped
from kvpool.index.catalog.records import (
    Allocation,
    BlockMeta,
    CatalogFullError,
    LeaseRecord,
    NodeSpace,
    Replica,
)
from kvpool.index.catalog.replication import Replication
from kvpool.index.catalog.ssd import SsdTier
from kvpool.index.catalog.state import CatalogState
from kvpool.index.heat import ReplicationConfig
from kvpool.storage.allocator import ExtentAllocator


class BlockCatalog(CatalogState):
    """Blocks, replicas, per-node space and leases of the whole cluster.

    ``replication`` (heat, extra replicas) and ``ssd_tier`` (SSD copies,
    promotion) work on the same state.
    """

    def __init__(
        self,
        policy: str = "lru",
        alignment: int = 4096,
        alloc_ttl: float = 30.0,
        lease_ttl: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        replication: ReplicationConfig | None = None,
        grant_ttl: float = 5.0,
    ) -> None:
        super().__init__(policy, alignment, alloc_ttl, lease_ttl, grant_ttl, clock)
        self.replication = Replication(self, replication or ReplicationConfig())
        self.ssd_tier = SsdTier(self)

    # -- nodes ----------------------------------------------------------------

    def add_node(
        self,
        node_id: str,
        capacity: int,
        info: dict[str, Any],
        host_id: str = "",
        has_ssd: bool = False,
        grace_s: float = 0.0,
    ) -> None:
        """Register (or re-register) a node; a re-registering node starts empty here.

        ``grace_s``: a node re-joining after a master restart may have ranges
        that clients still read under leases the old master granted; nothing
        is allocated (or evicted) there until they have run out.
        """
        if node_id in self.nodes:
            self.remove_node(node_id)
        self.nodes[node_id] = NodeSpace(
            node_id,
            info,
            ExtentAllocator(capacity, self.alignment),
            make_policy(self.policy_name),
            make_policy(self.policy_name),
            host_id,
            self.clock(),
            ssd={} if has_ssd else None,
            usable_at=self.clock() + grace_s,
        )

    def restore_blocks(
        self,
        node_id: str,
        blocks: Sequence[tuple[bytes, int, int, int | None, bytes | None, bool]],
    ) -> list[int]:
        """Re-admit blocks a node still holds (after a master restart); returns the
        offsets refused (the node drops those blocks: nobody will read them).

        Each item is (key, offset, size, checksum, parent, confirmed): ``confirmed``
        when a master made it visible, else it was written whole and its commit
        never reached a master (an acknowledged put it must not lose, or the loser
        of a race for its key: kvpool.index.catalog.state ``supersede``). One put's
        bytes per key: a block of a key already restored is refused unless it is
        confirmed and on another node (a replica); a confirmed block replaces one
        that was restored unconfirmed (nodes register in any order; a node lists
        its confirmed blocks first). Overlapping or out-of-range extents are refused.
        """
        node = self.nodes[node_id]
        refused: list[int] = []
        for key, offset, size, checksum, parent, confirmed in blocks:
            known = self.blocks.get(key)
            if known is not None:
                here = any(r.node_id == node_id for r in known.replicas)
                if here or not confirmed:
                    refused.append(offset)
                    continue
                if all(r.unconfirmed for r in known.replicas):
                    self.remove(key)  # guessed: a lease taken since keeps its bytes
            try:
                node.allocator.reserve(offset, size)
            except ValueError:
                refused.append(offset)
                continue
            replica = Replica(node_id, offset, size, unconfirmed=not confirmed)
            self.add_replica(key, size, parent, replica, checksum, tell_node=False)
        return refused

    def remove_node(self, node_id: str) -> list[bytes]:
        """Forget a node: its replicas and pending allocations. Returns keys now gone."""
        node = self.nodes.pop(node_id, None)
        if node is None:
            return []
        for alloc_id in [a for a, alloc in self.pending.items() if alloc.node_id == node_id]:
            self.forget_pending(alloc_id)
        # Removed blocks still leased: their ranges there went with the node (a
        # node re-registering under the same id must not have them freed later).
        for record in self.leases.values():
            for block in record.blocks:
                if block.removed:
                    block.replicas = [r for r in block.replicas if r.node_id != node_id]
        gone = []
        for key, block in list(self.blocks.items()):
            block.replicas = [r for r in block.replicas if r.node_id != node_id]
            if not self.after_replica_loss(block):
                gone.append(key)
        return gone

    def touch_node(self, node_id: str) -> bool:
        node = self.nodes.get(node_id)
        if node is not None:
            node.last_seen = self.clock()
        return node is not None

    def dead_nodes(self, ttl: float) -> list[str]:
        now = self.clock()
        return [n.node_id for n in self.nodes.values() if now - n.last_seen > ttl]

    def grace_left(self) -> float:
        """Seconds until the next node in its re-join grace becomes usable (0: none)."""
        now = self.clock()
        waits = [n.usable_at - now for n in self.nodes.values() if n.usable_at > now]
        return min(waits, default=0.0)

    def has_usable_node(self) -> bool:
        """Whether some node is past its re-join grace (may take allocations now)."""
        now = self.clock()
        return any(n.usable_at <= now for n in self.nodes.values())

    def dram_capacity(self) -> int:
        """Bytes of DRAM all nodes together contribute."""
        return sum(n.allocator.capacity for n in self.nodes.values())

    # -- puts -------------------------------------------------------------------

    def allocate(
        self,
        key: bytes,
        size: int,
        parent: bytes | None,
        replicas: int = 1,
        node_id: str | None = None,
        avoid: Collection[str] = (),
    ) -> list[Allocation] | None:
        """Room for ``key`` on up to ``replicas`` distinct nodes; None if already stored.

        Nodes are tried in order of free space (or only ``node_id``),
        evicting unleased blocks as needed. Nodes in ``avoid`` (a writer saw
        them fail; the master has not dropped them yet) are tried only when no
        other node can take even one replica: a replica placed on a dead node
        leaves the block one copy short. CatalogFullError if not even one
        replica fits.
        """
        if key in self.blocks or key in self.keys_in_flight:
            return None
        nodes = self.nodes_by_free_space(only=node_id)
        placed = self.place(
            key, size, parent, [n for n in nodes if n.node_id not in avoid], replicas
        )
        if not placed and avoid:  # one replica on a node a writer saw fail beats none
            placed = self.place(key, size, parent, [n for n in nodes if n.node_id in avoid], 1)
        if not placed:
            raise CatalogFullError(
                f"no node can hold a block of {size} bytes "
                f"({len(self.nodes)} node(s); everything evictable is leased or in flight)"
            )
        return placed

    def grant(self, size: int, count: int, avoid: Collection[str] = ()) -> list[Allocation]:
        """Up to ``count`` keyless allocations of ``size`` bytes, spread by free space,
        none on a node in ``avoid`` (see ``allocate``).

        Grants evict like puts do (they are puts whose keys come later), but
        never fail: a cluster without room yields fewer grants.
        """
        granted: list[Allocation] = []
        while len(granted) < count:
            for node in self.nodes_by_free_space():
                if node.node_id in avoid:
                    continue
                offset = self.make_room(node, size)
                if offset is not None:
                    granted.append(self.pend(None, node, offset, size, None, ttl=self.grant_ttl))
                    break
            else:
                break
        return granted

    def commit(self, alloc_id: int) -> Allocation | None:
        """Make an allocation's replica visible; None if it expired or its node left.

        A grant cannot be committed here (it has no key): see ``commit_grant``.
        """
        pending = self.pending.get(alloc_id)
        if pending is None or pending.key is None:
            return None
        if pending.superseded:  # another put of its key was committed first
            if self.forget_pending(alloc_id) is not None:  # written whole: the node drops it
                self.nodes[pending.node_id].events.append(RangeFreed(pending.offset, alloc_id))
            return None
        alloc = self.forget_pending(alloc_id, free=False)
        if alloc is None or alloc.key is None:
            return None
        if alloc.extra and alloc.key not in self.blocks:  # removed meanwhile
            self.nodes[alloc.node_id].allocator.free(alloc.offset)
            return None
        replica = Replica(
            alloc.node_id, alloc.offset, alloc.size, primary=not alloc.extra, alloc_id=alloc_id
        )
        self.add_replica(alloc.key, alloc.size, alloc.parent, replica)
        return alloc

    def commit_grant(self, alloc_id: int, key: bytes, parent: bytes | None) -> bool | None:
        """Bind a filled grant to ``key`` and make it visible.

        True: committed. False: ``key`` is already stored (the grant's space is
        freed; the caller's bytes were simply not needed). None: no such grant
        (expired, its node left, or not a grant).

        A put of ``key`` still in flight (allocated with its key, or reserved)
        does not stop this one: the first commit wins, so a put its writer was
        already told succeeded (pipelined commits) is never dropped for a put
        that may yet fail. The put in flight is superseded: its commit frees
        its range and answers None (its writer then finds the key stored).

        An allocation made with its key (not a grant) is committed here too when
        ``key`` is that key: a node commits blocks whose writer sealed them and
        never committed (kvpool.cluster.unconfirmed) without knowing which kind
        each came from.
        """
        alloc = self.pending.get(alloc_id)
        if alloc is None:
            return None
        if alloc.key is not None:
            return True if alloc.key == key and self.commit(alloc_id) is not None else None
        if self.forget_pending(alloc_id, free=False) is None:
            return None  # its node left
        node = self.nodes[alloc.node_id]
        if key in self.blocks:
            node.allocator.free(alloc.offset)
            return False
        self.supersede(key)
        alloc.key, alloc.parent = key, parent
        replica = Replica(alloc.node_id, alloc.offset, alloc.size, alloc_id=alloc_id)
        self.add_replica(key, alloc.size, parent, replica)
        return True

    def revoke(self, alloc_id: int) -> None:
        """Give an allocation's space back (a failed or abandoned write)."""
        self.forget_pending(alloc_id)

    def set_checksum(self, key: bytes, checksum: int) -> None:
        block = self.blocks.get(key)
        if block is not None:
            block.checksum = checksum

    # -- reads ------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self.blocks for key in keys]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            if key not in self.blocks:
                return i
        return len(keys)

    def locate(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Node ids holding each key (no lease, no heat: a pure look-up)."""
        return [[r.node_id for r in b.replicas] if (b := self.blocks.get(k)) else [] for k in keys]

    def lease(
        self, keys: Sequence[bytes], prefix: bool = True
    ) -> tuple[int, list[BlockMeta | None]]:
        """Pin blocks for reading: the stored prefix (``prefix``) or each stored key.

        Returns (lease id, one BlockMeta or None per key; with ``prefix`` the
        list stops at the first miss). Counts a hit on each replica's node.
        """
        found: list[BlockMeta | None] = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None and prefix:
                break
            found.append(block)
            if block is not None:
                block.leases += 1
                self.replication.count_read(block)
        held = [b for b in found if b is not None]
        lease_id = self.new_id() if held else 0
        if held:
            self.leases[lease_id] = LeaseRecord(held, self.clock() + self.lease_ttl)
        return lease_id, found

    def pin(self, keys: Sequence[bytes], seconds: float) -> None:
        """Keep the stored ``keys`` from eviction for ``seconds``, like a lease that
        nobody releases (a new master term: readers holding the previous term's
        leases may still copy them)."""
        held = [self.blocks[k] for k in keys if k in self.blocks]
        for block in held:
            block.leases += 1
        if held:
            self.leases[self.new_id()] = LeaseRecord(held, self.clock() + seconds)

    def release(self, lease_id: int) -> None:
        """End a lease (unknown or already ended ids are ignored)."""
        record = self.leases.pop(lease_id, None)
        if record is None:
            return
        for block in record.blocks:
            self.unpin(block)

    def remove(self, key: bytes) -> bool:
        """Hide ``key`` at once; its DRAM ranges are freed now, or with its last lease."""
        block = self.blocks.pop(key, None)
        if block is None:
            return False
        block.removed = True
        self.with_extras.discard(key)
        for replica in block.replicas:
            node = self.nodes[replica.node_id]
            node.dirty.pop(key, None)
            if node.ssd is not None and node.ssd.pop(key, None) is not None:
                node.events.append(SsdCopyDropped(key))
            if replica.tier == "dram":
                self.policy_of(replica).on_remove(key)
        block.replicas = [r for r in block.replicas if r.tier == "dram"]
        if block.leases == 0:
            self.free_extents(block)
        return True

    def expire(self) -> tuple[int, int]:
        """Revoke allocations and release leases past their deadline; (allocs, leases)."""
        now = self.clock()
        allocs = [a for a, alloc in self.pending.items() if alloc.deadline < now]
        for alloc_id in allocs:
            self.forget_pending(alloc_id)
        leases = [lid for lid, rec in self.leases.items() if rec.deadline < now]
        for lease_id in leases:
            self.release(lease_id)
        return len(allocs), len(leases)
