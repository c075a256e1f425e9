"""What every part of the master shares: the catalog, its lock, node regions, metrics.

Invariants: every read or change of ``catalog`` or ``regions`` happens under
``lock``; no handler holds it across a network call (calls to nodes happen
between two critical sections). ``regions`` has an entry for exactly the
nodes the catalog knows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpool.cluster.master.config import MasterConfig
from kvpool.cluster.metrics import Metrics
from kvpool.index.catalog import BlockCatalog
from kvpool.transport.base import RegionInfo


@dataclass
class MasterState:
    config: MasterConfig
    catalog: BlockCatalog
    metrics: Metrics
    lock: threading.Lock = field(default_factory=threading.Lock)
    regions: dict[str, RegionInfo] = field(default_factory=dict)
    # This master's term: only grows across restarts and failovers (kvpool.cluster.master.term)
    epoch: int = 0
    started: float = field(default_factory=time.monotonic)

    def regions_of(self, node_ids: Iterable[str]) -> dict[str, RegionInfo]:
        """The regions of ``node_ids`` (each once) that are still registered."""
        return {n: self.regions[n] for n in set(node_ids) if n in self.regions}

    def refresh_gauges(self) -> None:
        self.metrics.blocks.set(len(self.catalog.blocks))
        self.metrics.nodes.set(len(self.catalog.nodes))
        for node_id, node in self.catalog.nodes.items():
            self.metrics.capacity.labels(node_id).set(node.allocator.capacity)
            self.metrics.used.labels(node_id).set(node.allocator.used_bytes)
