"""The cluster's block catalog (installed as ``kvpool.index.catalog``).

- ``block_catalog``: ``BlockCatalog``, the public operations (nodes, puts,
  grants, leases, removal, expiry) and the catalog's invariants;
- ``state``: the records and the primitive steps that keep space exact;
- ``replication``: read heat and extra replicas;
- ``ssd``: SSD write-behind copies, demotion and promotion;
- ``events``: what a node must learn about its region (typed events);
- ``records``: the plain data.

Imports only errors/config, kvpool.storage.allocator, kvpool.eviction and
kvpool.index.heat: no RPC, no master.
"""

from kvpool.index.catalog.block_catalog import BlockCatalog
from kvpool.index.catalog.events import BlockCommitted, NodeEvent, RangeFreed, SsdCopyDropped
from kvpool.index.catalog.records import (
    Allocation,
    BlockMeta,
    CatalogFullError,
    LeaseRecord,
    NodeSpace,
    Replica,
)

__all__ = [
    "Allocation",
    "BlockCatalog",
    "BlockCommitted",
    "BlockMeta",
    "CatalogFullError",
    "LeaseRecord",
    "NodeEvent",
    "NodeSpace",
    "RangeFreed",
    "Replica",
    "SsdCopyDropped",
]
