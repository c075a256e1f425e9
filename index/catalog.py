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
  leased block hides it at once and frees its extents when the last lease
  ends or expires (``lease_ttl``), so a slow reader never reads reused bytes
  while its lease holds;
- a node that leaves (death, restart) takes all its replicas and pending
  allocations with it;
- replicas are primary (placed by a put) or extra (added for read load, see
  kvpool.index.heat); each node evicts extras before primaries, and a block
  whose primaries all left keeps an extra as its new primary;
- a node with an SSD tier keeps SSD copies of its coldest DRAM blocks
  (written ahead by the master's cleaner); evicting a DRAM replica that has
  an SSD copy leaves an SSD-only replica, which a read promotes back to DRAM
  before anyone is told where to read. Only DRAM replicas are tracked by
  the eviction policies; the node evicts its own SSD.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.eviction import EvictionPolicy, make_policy
from kvpool.index.heat import ReplicationConfig, decayed
from kvpool.storage.allocator import ExtentAllocator


@dataclass
class Replica:
    node_id: str
    offset: int
    size: int
    primary: bool = True
    tier: str = "dram"  # "ssd": bytes only in the node's SSD tier (offset meaningless)


@dataclass(eq=False)
class BlockMeta:
    key: bytes
    size: int
    parent: bytes | None
    replicas: list[Replica] = field(default_factory=list)
    checksum: int | None = None  # reported by the node that holds the bytes
    leases: int = 0
    removed: bool = False  # hidden; extents freed when the last lease ends
    heat: float = 0.0  # decayed read count (kvpool.index.heat) as of heat_at
    heat_at: float = 0.0


@dataclass
class Allocation:
    alloc_id: int
    key: bytes | None  # None: a grant, bound to a key at commit
    node_id: str
    offset: int
    size: int
    parent: bytes | None
    deadline: float
    extra: bool = False  # an extra replica of an already stored block


@dataclass
class NodeSpace:
    node_id: str
    info: dict[str, Any]  # the node's advertised region (transport details)
    allocator: ExtentAllocator
    policy: EvictionPolicy  # primaries
    extras: EvictionPolicy  # extra replicas: evicted first
    host_id: str = ""
    last_seen: float = 0.0
    load: float = 0.0  # decayed count of reads routed here (as of load_at)
    load_at: float = 0.0
    ssd: dict[bytes, int] | None = None  # keys with an SSD copy on this node (None: no SSD)
    usable_at: float = 0.0  # no allocation here before (grace after re-joining a new master)
    dirty: dict[bytes, None] = field(default_factory=dict)  # DRAM-only, oldest first
    # What the node must learn about its own region, in order: ("commit", key,
    # offset, size, parent) and ("free", offset). The master drains it into
    # heartbeat replies so a node can re-register its blocks after a master
    # restart.
    outbox: list[tuple[Any, ...]] = field(default_factory=list)


@dataclass
class LeaseRecord:
    blocks: list[BlockMeta]
    deadline: float


class CatalogFullError(Exception):
    """No node can make room for a block (everything evictable is leased or pending)."""


class BlockCatalog:
    """Blocks, replicas, per-node space and leases of the whole cluster."""

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
        make_policy(policy)
        self.replication = replication or ReplicationConfig()
        self.policy_name, self.alignment = policy, alignment
        self.alloc_ttl, self.lease_ttl, self.clock = alloc_ttl, lease_ttl, clock
        self.grant_ttl = min(grant_ttl, alloc_ttl)
        self.nodes: dict[str, NodeSpace] = {}
        self.blocks: dict[bytes, BlockMeta] = {}
        self.pending: dict[int, Allocation] = {}
        self.leases: dict[int, LeaseRecord] = {}
        self._pending_keys: dict[bytes, int] = {}  # key -> allocations in flight
        self.granted_bytes = 0  # space held by grants (pending allocations with no key)
        # Allocation and lease ids start at a random point: ids a client still
        # holds from a previous master (across a restart) never name this one's.
        self._ids = itertools.count(1 + secrets.randbits(52))
        self._with_extras: set[bytes] = set()  # blocks that have extra replicas
        self.evictions = 0

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

    def restore_ssd(self, node_id: str, blocks: Sequence[tuple[bytes, int, bytes | None]]) -> int:
        """Re-admit the (key, size, parent) blocks a node keeps on its SSD."""
        node = self.nodes[node_id]
        if node.ssd is None:
            return 0
        for key, size, parent in blocks:
            node.ssd[key] = size
            node.dirty.pop(key, None)
            block = self.blocks.get(key)
            if block is None or all(r.node_id != node_id for r in block.replicas):
                self._add_replica(
                    key, size, parent, Replica(node_id, -1, size, tier="ssd"), tell_node=False
                )
        return len(blocks)

    def restore_blocks(
        self, node_id: str, blocks: Sequence[tuple[bytes, int, int, int | None, bytes | None]]
    ) -> int:
        """Re-admit blocks a node still holds (after a master restart); returns how many.

        Each item is (key, offset, size, checksum, parent); overlapping or
        out-of-range extents are skipped.
        """
        node = self.nodes[node_id]
        accepted = 0
        for key, offset, size, checksum, parent in blocks:
            try:
                node.allocator.reserve(offset, size)
            except ValueError:
                continue
            replica = Replica(node_id, offset, size)
            self._add_replica(key, size, parent, replica, checksum, tell_node=False)
            accepted += 1
        return accepted

    def remove_node(self, node_id: str) -> list[bytes]:
        """Forget a node: its replicas and pending allocations. Returns keys now gone."""
        node = self.nodes.pop(node_id, None)
        if node is None:
            return []
        for alloc_id in [a for a, alloc in self.pending.items() if alloc.node_id == node_id]:
            self._forget_pending(alloc_id)
        gone = []
        for key, block in list(self.blocks.items()):
            block.replicas = [r for r in block.replicas if r.node_id != node_id]
            if not self._after_replica_loss(block):
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

    # -- puts -------------------------------------------------------------------

    def allocate(
        self,
        key: bytes,
        size: int,
        parent: bytes | None,
        replicas: int = 1,
        node_id: str | None = None,
    ) -> list[Allocation] | None:
        """Room for ``key`` on up to ``replicas`` distinct nodes; None if already stored.

        Nodes are tried in order of free space (or only ``node_id``),
        evicting unleased blocks as needed. CatalogFullError if not even one
        replica fits.
        """
        if key in self.blocks or key in self._pending_keys:
            return None
        placed: list[Allocation] = []
        for node in self._nodes_by_free_space(only=node_id):
            if len(placed) == replicas:
                break
            offset = self._make_room(node, size)
            if offset is not None:
                placed.append(self._pend(key, node, offset, size, parent))
        if not placed:
            raise CatalogFullError(
                f"no node can hold a block of {size} bytes "
                f"({len(self.nodes)} node(s); everything evictable is leased or in flight)"
            )
        return placed

    def grant(self, size: int, count: int) -> list[Allocation]:
        """Up to ``count`` keyless allocations of ``size`` bytes, spread by free space.

        Grants evict like puts do (they are puts whose keys come later), but
        never fail: a cluster without room yields fewer grants.
        """
        granted: list[Allocation] = []
        while len(granted) < count:
            for node in self._nodes_by_free_space():
                offset = self._make_room(node, size)
                if offset is not None:
                    granted.append(self._pend(None, node, offset, size, None, ttl=self.grant_ttl))
                    break
            else:
                break
        return granted

    def allocate_replica(self, key: bytes, node_id: str | None = None) -> Allocation | None:
        """Room for one extra replica of a stored block, on ``node_id`` or the emptiest
        node not holding it. None if the block is missing, already on that node, or
        has a replica in flight; CatalogFullError if the node has no room."""
        block = self.blocks.get(key)
        if block is None or key in self._pending_keys:
            return None
        holders = {r.node_id for r in block.replicas}
        candidates = [
            n for n in self._nodes_by_free_space(only=node_id) if n.node_id not in holders
        ]
        for node in candidates:
            offset = self._make_room(node, block.size)
            if offset is not None:
                return self._pend(key, node, offset, block.size, block.parent, extra=True)
        if candidates:
            raise CatalogFullError(f"no room for a replica of {block.size} bytes")
        return None

    def commit(self, alloc_id: int) -> Allocation | None:
        """Make an allocation's replica visible; None if it expired or its node left.

        A grant cannot be committed here (it has no key): see ``commit_grant``.
        """
        pending = self.pending.get(alloc_id)
        if pending is None or pending.key is None:
            return None
        alloc = self._forget_pending(alloc_id, free=False)
        if alloc is None or alloc.key is None:
            return None
        if alloc.extra and alloc.key not in self.blocks:  # removed meanwhile
            self.nodes[alloc.node_id].allocator.free(alloc.offset)
            return None
        replica = Replica(alloc.node_id, alloc.offset, alloc.size, primary=not alloc.extra)
        self._add_replica(alloc.key, alloc.size, alloc.parent, replica)
        return alloc

    def commit_grant(self, alloc_id: int, key: bytes, parent: bytes | None) -> bool | None:
        """Bind a filled grant to ``key`` and make it visible.

        True: committed. False: ``key`` is already stored or being put (the
        grant's space is freed; the caller's bytes were simply not needed).
        None: no such grant (expired, its node left, or not a grant).
        """
        alloc = self.pending.get(alloc_id)
        if alloc is None or alloc.key is not None:
            return None
        if self._forget_pending(alloc_id, free=False) is None:
            return None  # its node left
        node = self.nodes[alloc.node_id]
        if key in self.blocks or key in self._pending_keys:
            node.allocator.free(alloc.offset)
            return False
        alloc.key, alloc.parent = key, parent
        self._add_replica(key, alloc.size, parent, Replica(alloc.node_id, alloc.offset, alloc.size))
        return True

    def revoke(self, alloc_id: int) -> None:
        """Give an allocation's space back (a failed or abandoned write)."""
        self._forget_pending(alloc_id)

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
                self._count_read(block)
        held = [b for b in found if b is not None]
        lease_id = next(self._ids) if held else 0
        if held:
            self.leases[lease_id] = LeaseRecord(held, self.clock() + self.lease_ttl)
        return lease_id, found

    def add_reads(self, key: bytes, reads: int) -> None:
        """Reads a client served from its lease cache, for the heat accounting."""
        block = self.blocks.get(key)
        if block is not None and isinstance(reads, int) and reads > 0:
            now = self.clock()
            half_life = self.replication.half_life_s
            block.heat = decayed(block.heat, block.heat_at, now, half_life) + reads
            block.heat_at = now

    def hot_replicas(self, blocks: Sequence[BlockMeta | None]) -> list[Allocation]:
        """Extra-replica allocations for the hot blocks among ``blocks`` (just read).

        The reader that holds the bytes fills them (or revokes); see ReplicationConfig.
        """
        config = self.replication
        orders = []
        for block in blocks:
            if (
                block is None
                or not config.enabled
                or block.heat < config.hot_reads
                or len(block.replicas) >= min(config.max_replicas, len(self.nodes))
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
        now, config, dropped = self.clock(), self.replication, 0
        for key in list(self._with_extras):
            block = self.blocks.get(key)
            if block is None:
                self._with_extras.discard(key)
                continue
            if decayed(block.heat, block.heat_at, now, config.half_life_s) >= config.cool_reads:
                continue
            if block.leases:
                continue
            for replica in [r for r in block.replicas if not r.primary]:
                node = self.nodes[replica.node_id]
                node.extras.on_remove(key)
                block.replicas.remove(replica)
                self._free_replica(node, replica)
                dropped += 1
            self._with_extras.discard(key)
        return dropped

    # -- SSD tier -------------------------------------------------------------

    def pick_for_ssd(self, node_id: str, max_bytes: int) -> list[BlockMeta]:
        """The oldest DRAM-only blocks of a node to copy to its SSD, pinned until
        ``ssd_stored`` (so their bytes stay put while the node writes them)."""
        node = self.nodes[node_id]
        picked: list[BlockMeta] = []
        total = 0
        for key in list(node.dirty):
            block = self.blocks.get(key)
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
        for block in picked:
            block.leases -= 1
            if block.removed and block.leases == 0:
                self._free_extents(block)
        node = self.nodes.get(node_id)
        if node is None or node.ssd is None:
            return
        for key in stored:
            meta = self.blocks.get(key)
            if meta is None:
                node.outbox.append(("ssd_drop", key))  # removed while it was written
                continue
            node.ssd[key] = meta.size
            node.dirty.pop(key, None)
        for key in dropped:
            self._forget_ssd_copy(node, key)

    def ssd_only(self, block: BlockMeta) -> bool:
        return not any(r.tier == "dram" for r in block.replicas)

    def reserve_promotion(self, block: BlockMeta) -> Allocation | None:
        """DRAM room for an SSD-only block on a node holding its SSD copy."""
        for replica in block.replicas:
            node = self.nodes[replica.node_id]
            offset = self._make_room(node, block.size)
            if offset is not None:
                return Allocation(
                    next(self._ids),
                    block.key,
                    node.node_id,
                    offset,
                    block.size,
                    block.parent,
                    self.clock() + self.alloc_ttl,
                )
        return None

    def finish_promotion(self, block: BlockMeta, alloc: Allocation, ok: bool) -> None:
        """The node loaded (``ok``) or failed to load the block into ``alloc``'s range."""
        node = self.nodes.get(alloc.node_id)
        if node is None:
            return
        replica = next((r for r in block.replicas if r.node_id == alloc.node_id), None)
        if not ok or replica is None or block.removed or replica.tier != "ssd":
            node.allocator.free(alloc.offset)
            if not ok:
                self._forget_ssd_copy(node, block.key)
            return
        replica.tier, replica.offset = "dram", alloc.offset
        self._policy_of(replica).on_insert(block.key, block.parent)
        node.outbox.append(("commit", block.key, alloc.offset, block.size, block.parent))

    def _forget_ssd_copy(self, node: NodeSpace, key: bytes) -> None:
        """The node no longer has ``key`` on SSD: an SSD-only replica there is gone."""
        assert node.ssd is not None
        node.ssd.pop(key, None)
        block = self.blocks.get(key)
        if block is None:
            return
        block.replicas = [
            r for r in block.replicas if not (r.node_id == node.node_id and r.tier == "ssd")
        ]
        self._after_replica_loss(block)

    def release(self, lease_id: int) -> None:
        record = self.leases.pop(lease_id, None)
        if record is None:
            return
        for block in record.blocks:
            block.leases -= 1
            if block.removed and block.leases == 0:
                self._free_extents(block)

    def remove(self, key: bytes) -> bool:
        block = self.blocks.pop(key, None)
        if block is None:
            return False
        block.removed = True
        self._with_extras.discard(key)
        for replica in block.replicas:
            node = self.nodes[replica.node_id]
            node.dirty.pop(key, None)
            if node.ssd is not None and node.ssd.pop(key, None) is not None:
                node.outbox.append(("ssd_drop", key))
            if replica.tier == "dram":
                self._policy_of(replica).on_remove(key)
        block.replicas = [r for r in block.replicas if r.tier == "dram"]
        if block.leases == 0:
            self._free_extents(block)
        return True

    def expire(self) -> tuple[int, int]:
        """Revoke allocations and release leases past their deadline; (allocs, leases)."""
        now = self.clock()
        allocs = [a for a, alloc in self.pending.items() if alloc.deadline < now]
        for alloc_id in allocs:
            self._forget_pending(alloc_id)
        leases = [lid for lid, rec in self.leases.items() if rec.deadline < now]
        for lease_id in leases:
            self.release(lease_id)
        return len(allocs), len(leases)

    # -- helpers ----------------------------------------------------------------

    def _make_room(self, node: NodeSpace, size: int) -> int | None:
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
                    self._free_replica(node, replica)
                    replica.tier, replica.offset = "ssd", -1
                    if not replica.primary:  # extras do not linger on SSD
                        self._forget_ssd_copy(node, key)
                        node.outbox.append(("ssd_drop", key))
            return
        node.dirty.pop(key, None)
        mine = [r for r in block.replicas if r.node_id == node.node_id]
        block.replicas = [r for r in block.replicas if r.node_id != node.node_id]
        for replica in mine:
            self._free_replica(node, replica)
        self._after_replica_loss(block)

    def _add_replica(
        self,
        key: bytes,
        size: int,
        parent: bytes | None,
        replica: Replica,
        checksum: int | None = None,
        tell_node: bool = True,
    ) -> None:
        block = self.blocks.get(key)
        if block is None:
            block = self.blocks[key] = BlockMeta(key, size, parent, checksum=checksum)
        block.replicas.append(replica)
        node = self.nodes[replica.node_id]
        if replica.tier == "ssd":
            return
        self._policy_of(replica).on_insert(key, parent)
        if node.ssd is not None and key not in node.ssd:
            node.dirty[key] = None
        if not replica.primary:
            self._with_extras.add(key)
        if tell_node:
            node.outbox.append(("commit", key, replica.offset, size, parent))

    def _pend(
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
        alloc = Allocation(
            next(self._ids), key, node.node_id, offset, size, parent, deadline, extra
        )
        self.pending[alloc.alloc_id] = alloc
        if key is not None:
            self._pending_keys[key] = self._pending_keys.get(key, 0) + 1
        else:
            self.granted_bytes += size
        return alloc

    def _nodes_by_free_space(self, only: str | None = None) -> list[NodeSpace]:
        now = self.clock()
        usable = [n for n in self.nodes.values() if n.usable_at <= now]
        if only is not None:
            return [n for n in usable if n.node_id == only]
        # Most free space first; on ties, the node with most extra replicas,
        # which it can drop without losing a block.
        return sorted(usable, key=lambda n: (-n.allocator.free_bytes, -len(n.extras)))

    def grace_left(self) -> float:
        """Seconds until the next node in its re-join grace becomes usable (0: none)."""
        now = self.clock()
        waits = [n.usable_at - now for n in self.nodes.values() if n.usable_at > now]
        return min(waits, default=0.0)

    def _policy_of(self, replica: Replica) -> EvictionPolicy:
        node = self.nodes[replica.node_id]
        return node.policy if replica.primary else node.extras

    def _after_replica_loss(self, block: BlockMeta) -> bool:
        """A block just lost replicas: forget it if none is left, else make sure one is
        primary. Returns whether the block is still stored."""
        if not block.replicas:
            del self.blocks[block.key]
            self._with_extras.discard(block.key)
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

    def _count_read(self, block: BlockMeta) -> None:
        """Heat the block, refresh its replicas' recency, route the read to the least
        loaded replica (listed first)."""
        now, half_life = self.clock(), self.replication.half_life_s
        block.heat = decayed(block.heat, block.heat_at, now, half_life) + 1.0
        block.heat_at = now
        for replica in block.replicas:
            if replica.tier == "dram":
                self._policy_of(replica).on_access(block.key)
        if len(block.replicas) > 1:  # DRAM first, then the least loaded node
            block.replicas.sort(
                key=lambda r: (r.tier != "dram", self._load(self.nodes[r.node_id], now))
            )
        node = self.nodes[block.replicas[0].node_id]
        node.load = self._load(node, now) + 1.0
        node.load_at = now

    def _load(self, node: NodeSpace, now: float) -> float:
        return decayed(node.load, node.load_at, now, self.replication.half_life_s)

    def _free_replica(self, node: NodeSpace, replica: Replica) -> None:
        node.allocator.free(replica.offset)
        node.outbox.append(("free", replica.offset))

    def _forget_pending(self, alloc_id: int, free: bool = True) -> Allocation | None:
        alloc = self.pending.pop(alloc_id, None)
        if alloc is None:
            return None
        if alloc.key is None:
            self.granted_bytes -= alloc.size
        else:
            count = self._pending_keys[alloc.key] - 1
            if count:
                self._pending_keys[alloc.key] = count
            else:
                del self._pending_keys[alloc.key]
        node = self.nodes.get(alloc.node_id)
        if free and node is not None:
            node.allocator.free(alloc.offset)
        return None if node is None else alloc

    def _free_extents(self, block: BlockMeta) -> None:
        for replica in block.replicas:
            node = self.nodes.get(replica.node_id)
            if node is not None and replica.tier == "dram":
                self._free_replica(node, replica)
        block.replicas = []
