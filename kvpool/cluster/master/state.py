"""What every part of the master shares: the catalog, its lock, node regions, metrics.

Invariants: every read or change of ``catalog`` or ``regions`` happens under
``lock``; no handler holds it across a network call (calls to nodes happen
between two critical sections). ``regions`` has an entry for exactly the
nodes the catalog knows.

The catalog's gauges (blocks, nodes, each node's capacity and used bytes) are
read when ``/metrics`` is scraped, not kept up to date by every allocate and
remove: refreshing them under ``lock`` cost ~2.3 us per node on each (37 us
with 16 nodes, issue 17). A scrape reads them without the lock: each value is
one read of an int or a dict's length, consistent on its own, not with the
others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

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
    # Nodes that have capacity / used gauges (kept equal to the catalog's by track_nodes)
    _gauged: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        metrics = self.metrics  # the lambdas read self.catalog: a new term swaps it
        metrics.blocks.set_function(lambda: len(self.catalog.blocks))
        metrics.nodes.set_function(lambda: len(self.catalog.nodes))
        metrics.granted.set_function(lambda: self.catalog.granted_bytes)

    def regions_of(self, node_ids: Iterable[str]) -> dict[str, RegionInfo]:
        """The regions of ``node_ids`` (each once) that are still registered."""
        return {n: self.regions[n] for n in set(node_ids) if n in self.regions}

    def track_nodes(self) -> None:
        """Give each node the catalog knows capacity and used gauges (read at scrape
        time) and drop those of nodes it no longer knows. Call under ``lock`` after
        the set of nodes changed: a registration, a dropped node, a new term."""
        nodes = self.catalog.nodes
        metrics = self.metrics
        for node_id in nodes.keys() - self._gauged:
            metrics.capacity.labels(node_id).set_function(partial(self._node_bytes, node_id, False))
            metrics.used.labels(node_id).set_function(partial(self._node_bytes, node_id, True))
        for node_id in self._gauged - nodes.keys():
            metrics.capacity.remove(node_id)
            metrics.used.remove(node_id)
        self._gauged = set(nodes)

    def _node_bytes(self, node_id: str, used: bool) -> int:
        """A node's used (or total) bytes as the catalog has them now; 0 once the
        catalog forgot the node (until ``track_nodes`` drops its gauges)."""
        node = self.catalog.nodes.get(node_id)
        if node is None:
            return 0
        return node.allocator.used_bytes if used else node.allocator.capacity
