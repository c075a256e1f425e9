"""The catalog's records: blocks and their replicas, allocations, node spaces, leases.

Plain data, no behaviour: kvpool.index.catalog.state keeps them consistent.
A ``BlockMeta`` is shared by reference between ``BlockCatalog.blocks`` and
the lease records that pin it, so a block hidden by ``remove`` stays
reachable (and its extents allocated) through its leases until the last
one ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.eviction import EvictionPolicy
from kvpool.index.catalog.events import NodeEvent
from kvpool.storage.allocator import ExtentAllocator


class CatalogFullError(Exception):
    """No node can make room for a block (everything evictable is leased or pending)."""


@dataclass
class Replica:
    node_id: str
    offset: int
    size: int
    primary: bool = True
    tier: str = "dram"  # "ssd": bytes only in the node's SSD tier (offset meaningless)
    # The allocation that filled this DRAM range (this master term's id; 0: unknown,
    # a block the node re-registered). Events about the range name it, so a node
    # never applies a late event to a newer allocation of the same range.
    alloc_id: int = 0
    # Restored from a node that never heard its commit confirmed (a block that
    # another node reports confirmed replaces it: BlockCatalog.restore_blocks).
    unconfirmed: bool = False


@dataclass(eq=False)
class BlockMeta:
    key: bytes
    size: int
    parent: bytes | None
    replicas: list[Replica] = field(default_factory=list)
    checksum: int | None = None  # reported by the node that holds the bytes
    # Readers (and SSD write-behind) holding the block: never evicted while > 0.
    # One count per lease record that holds it, however many there are.
    leases: int = 0
    removed: bool = False  # hidden; extents freed (once) when the last lease ends
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
    # Another put of its key committed first (a grant: ``commit_grant``): it can
    # never become that key's block; its commit frees it and answers None.
    superseded: bool = False


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
    # What the node must learn about its own region, oldest first; handed out
    # (and cleared) by BlockCatalog.drain_events.
    events: list[NodeEvent] = field(default_factory=list)


@dataclass
class LeaseRecord:
    blocks: list[BlockMeta]
    deadline: float
