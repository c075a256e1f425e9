"""``MasterConfig``: the master's address, timeouts, replication and grant settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.cluster.wire import DEFAULT_ALLOC_TTL
from kvpool.config import DEFAULT_PORT
from kvpool.index.heat import ReplicationConfig

SSD_CLEAN_BATCH = 256 << 20  # bytes per node per reaper pass
#: keyless allocations one allocate call may hand out: a client's stock of small
#: blocks deepens up to 512 (kvpool.cluster.client.grants.MAX_STOCK), refilled at half;
#: 256 grants cost the master ~1 ms of one call (64: 0.6 ms, 1024: 3.7 ms round trip).
MAX_GRANTS = 256
#: The timeouts a master cannot run with at 0, negative or infinite (nan neither).
_POSITIVE_SECONDS = (
    "node_ttl",
    "lease_ttl",
    "alloc_ttl",
    "reap_interval",
    "grant_ttl",
    "leader_ttl",
)


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
    # The blocks a node re-registers with a new term are not evicted for this
    # long, so ranges named in leases the old term granted are not reused while
    # clients may still read them (covers the client lease cache's hold); the
    # node's free space takes allocations at once (writes are fenced by epoch).
    rejoin_grace_s: float = 2.0
    # A master that just started answers allocations "not ready" (clients retry)
    # until a node registered, for at most this long (then: the pool is full).
    startup_grace_s: float = 5.0
    # Keyless allocations handed to clients for their next puts expire after this;
    # clients use them for at most half of min(grant_ttl, rejoin_grace_s), and 1 s.
    grant_ttl: float = 5.0
    # Grants held by all clients together stay under this share of the cluster's DRAM.
    grant_share: float = 1 / 16
    # HA: etcd endpoints ("http://h:p,..."; "" = standalone), the cluster's name
    # in etcd, the leader lease TTL, and the address callers are pointed at.
    etcd: str = ""
    cluster: str = "default"
    leader_ttl: float = 3.0
    advertise: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.grant_share <= 1.0:  # also refuses nan
            raise ValueError(f"grant_share must be from 0 to 1, got {self.grant_share!r}")
        for name in _POSITIVE_SECONDS:
            value = getattr(self, name)
            if not 0.0 < value < math.inf:  # also refuses nan
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
