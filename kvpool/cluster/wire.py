"""Payloads the master, storage nodes and clients exchange (inside RPC requests).

Keys and parents travel as 16-byte ``bytes``; block placements as small
lists so a batch of thousands stays compact. Every message is a
``WireMessage`` dataclass: msgpack-native fields only, no pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.rpc.messages import WireMessage
from kvpool.transport.base import RegionInfo

DEFAULT_ALLOC_TTL = 120.0  # seconds a put (or a layer-by-layer block) has to commit

# How a node introduces itself (RPC hello name prefix): node.* calls need it.
NODE_HELLO = "kvpool-node"
# Master RPC method names.
REGISTER = "node.register"
HEARTBEAT = "node.heartbeat"
ALLOCATE = "put.allocate"
COMMIT = "put.commit"
REVOKE = "put.revoke"
LEASE = "get.lease"
RELEASE = "get.release"
EXISTS = "keys.exists"
PREFIX = "keys.prefix_match"
REMOVE = "keys.remove"
REPLICATE = "keys.replicate"
LOCATE = "keys.locate"
STATS = "stats"
REGIONS = "nodes.regions"  # -> {node_id: RegionInfo.to_dict()}: every registered node
# Node RPC method names (the master calls these on nodes with an SSD tier).
SSD_STORE = "ssd.store"  # [[key, offset, size, parent]] -> {"stored": [...], "dropped": [...]}
SSD_LOAD = "ssd.load"  # [[key, offset, alloc_id]] -> [ok, ...]
# What a heartbeat reply tells a node about its own region, in order (the
# master turns the catalog's typed events into these lists):
# alloc_id names the allocation that filled the range (0: unknown, e.g. a
# re-registered block); a node applies the event only to that allocation's entry.
EVENT_COMMIT = "commit"  # [EVENT_COMMIT, key, offset, size, parent, alloc_id]: a block is there
EVENT_FREE = "free"  # [EVENT_FREE, offset, alloc_id]: that block is gone, its range reusable
EVENT_SSD_DROP = "ssd_drop"  # [EVENT_SSD_DROP, key]: drop the SSD copy of key


@dataclass
class RegisterNode(WireMessage):
    """A node joining (or re-joining after a master restart) with the blocks it holds."""

    region: RegionInfo
    # [key, offset, size, checksum, parent, confirmed] for every block the node verified
    # (confirmed: a master made it visible; else written whole, its commit unheard).
    # The reply: {"restored": n, "epoch": e, "refused": [offsets the node drops]}
    blocks: list[list[Any]] = field(default_factory=list)
    ssd_blocks: list[list[Any]] = field(default_factory=list)  # [key, size, parent] on its SSD
    rejoin: bool = False  # registered with a master before (which may have leased its ranges)
    epoch: int = 0  # the highest master term the node has served (a lower master is stale)


@dataclass
class Heartbeat(WireMessage):
    node_id: str
    checksums: list[list[Any]] = field(default_factory=list)  # [key, xxh3_64] computed since
    epoch: int = 0  # the term the node registered in (another term: register again)


@dataclass
class HeartbeatReply(WireMessage):
    known: bool  # False: the master does not know this node (it restarted): register again
    events: list[list[Any]] = field(default_factory=list)  # EVENT_* lists, oldest first
    epoch: int = 0  # the master's term


@dataclass
class AllocateRequest(WireMessage):
    keys: list[bytes]
    sizes: list[int]
    parents: list[bytes | None]
    replicas: int = 1
    node_id: str = ""  # place on this node only ("" = spread by free space)
    # Also grant up to ``spare`` keyless allocations of ``spare_size`` bytes for
    # later puts (bound to their keys at commit): one round trip per put after this.
    spare: int = 0
    spare_size: int = 0
    # Nodes the client saw fail and the master may not have dropped yet: placed on
    # only when no other node can take a block, never granted (an older master
    # ignores the field).
    avoid: list[str] = field(default_factory=list)


@dataclass
class AllocateReply(WireMessage):
    # per key: None (already stored or in flight) or [[alloc_id, node_id, offset], ...]
    placements: list[list[list[Any]] | None]
    nodes: dict[str, RegionInfo]
    error: str = ""  # set when some key could not be placed anywhere (cluster full)
    full: list[int] = field(default_factory=list)  # indices of those keys
    ttl: float = 0.0  # an allocation not committed within this many seconds is revoked
    spares: list[list[Any]] = field(default_factory=list)  # [alloc_id, node_id, offset]
    spare_ttl: float = 0.0  # a grant not committed within this many seconds is revoked
    epoch: int = 0  # the master term of these allocations: every write is stamped with it


@dataclass
class IdsRequest(WireMessage):
    ids: list[int]


@dataclass
class CommitRequest(WireMessage):
    """Allocations to make visible. ``keys`` is empty, or one entry per id: None
    for an allocation made for a key, the key (and its parent) for a grant.

    Reply: one entry per id: True (visible), False (an allocation expired, or a
    grant's key was already stored: its space is freed), None (no such grant).
    """

    ids: list[int]
    keys: list[bytes | None] = field(default_factory=list)
    parents: list[bytes | None] = field(default_factory=list)


@dataclass
class ReleaseRequest(WireMessage):
    ids: list[int]
    reads: list[list[Any]] = field(default_factory=list)  # [key, n]: reads served from cache


@dataclass
class LeaseRequest(WireMessage):
    keys: list[bytes]
    prefix: bool = True  # stop at the first miss (prefix loads) or look up every key


@dataclass
class LeaseReply(WireMessage):
    lease_id: int
    # per key (up to the first miss when prefix): None or [size, [[node_id, offset], ...]]
    blocks: list[list[Any] | None]
    nodes: dict[str, RegionInfo]
    ttl: float
    # some blocks are stored but could not be brought into memory right now:
    # everything evictable there is leased (releasing cached leases may help)
    busy: bool = False
    # hot blocks the reader should copy to a new replica after reading them:
    # [index into blocks, alloc_id, node_id, offset]; commit (or revoke) when done
    replicate: list[list[Any]] = field(default_factory=list)
    epoch: int = 0  # the master term (replica orders are written stamped with it)


@dataclass
class KeysRequest(WireMessage):
    keys: list[bytes]


@dataclass
class ReplicateRequest(WireMessage):
    keys: list[bytes]
    node_id: str = ""  # "" = the emptiest node not holding the block


@dataclass
class ReplicateReply(WireMessage):
    # per key: None (missing, already there, in flight, or no room) or [alloc_id, node_id, offset]
    allocations: list[list[Any] | None]
    nodes: dict[str, RegionInfo]
    epoch: int = 0
