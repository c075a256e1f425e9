"""The master's catalog gauges: read at scrape time, one pair per known node.

Unit tests on a real catalog and a real prometheus registry (the test that a
running master serves them over HTTP is in test_cluster.py).
"""

from __future__ import annotations

from kvpool.cluster.master.config import MasterConfig
from kvpool.cluster.master.state import MasterState
from kvpool.cluster.metrics import Metrics
from kvpool.index.catalog import BlockCatalog

MiB = 1 << 20


def _state(*nodes: str) -> MasterState:
    catalog = BlockCatalog()
    for node_id in nodes:
        catalog.add_node(node_id, 64 * MiB, {}, "host")
    state = MasterState(MasterConfig(), catalog, Metrics("master"))
    state.track_nodes()
    return state


def _gauge(state: MasterState, name: str, node: str | None = None) -> float | None:
    labels = {} if node is None else {"node": node}
    return state.metrics.registry.get_sample_value(name, labels)


def test_gauges_follow_the_catalog_without_a_refresh() -> None:
    state = _state("a", "b")
    assert _gauge(state, "kvpool_nodes") == 2
    assert _gauge(state, "kvpool_capacity_bytes", "a") == 64 * MiB
    assert _gauge(state, "kvpool_used_bytes", "a") == 0
    allocs = state.catalog.allocate(b"k" * 16, MiB, None, replicas=2)
    assert allocs is not None
    for alloc in allocs:
        state.catalog.commit(alloc.alloc_id)
    # no call in between: the scrape reads the catalog as it is now
    assert _gauge(state, "kvpool_blocks") == 1
    assert _gauge(state, "kvpool_used_bytes", "a") == MiB
    assert _gauge(state, "kvpool_used_bytes", "b") == MiB
    state.catalog.remove(b"k" * 16)
    assert _gauge(state, "kvpool_blocks") == 0
    assert _gauge(state, "kvpool_used_bytes", "a") == 0


def test_a_dropped_node_loses_its_gauges() -> None:
    state = _state("a", "b")
    state.catalog.remove_node("b")
    assert _gauge(state, "kvpool_nodes") == 1
    assert _gauge(state, "kvpool_used_bytes", "b") == 0  # forgotten, not yet untracked
    state.track_nodes()
    assert _gauge(state, "kvpool_capacity_bytes", "b") is None
    assert _gauge(state, "kvpool_used_bytes", "b") is None
    assert _gauge(state, "kvpool_capacity_bytes", "a") == 64 * MiB


def test_a_new_term_reads_its_own_catalog() -> None:
    """A term swaps the catalog: the gauges read the new one, and nodes that did not
    re-register lose theirs at the next ``track_nodes``."""
    state = _state("a", "b")
    allocs = state.catalog.allocate(b"k" * 16, MiB, None)
    assert allocs is not None
    state.catalog.commit(allocs[0].alloc_id)
    state.catalog = BlockCatalog()
    state.catalog.add_node("b", 32 * MiB, {}, "host")
    assert _gauge(state, "kvpool_blocks") == 0
    assert _gauge(state, "kvpool_nodes") == 1
    state.track_nodes()
    assert _gauge(state, "kvpool_capacity_bytes", "a") is None
    assert _gauge(state, "kvpool_capacity_bytes", "b") == 32 * MiB


def test_a_re_registered_node_keeps_one_gauge_pair() -> None:
    state = _state("a")
    state.catalog.add_node("a", 16 * MiB, {}, "host")  # re-registers with a new size
    state.track_nodes()
    text = state.metrics.registry.collect()
    samples = [s for family in text for s in family.samples if s.name == "kvpool_capacity_bytes"]
    assert [(s.labels, s.value) for s in samples] == [({"node": "a"}, 16 * MiB)]
