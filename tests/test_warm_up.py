"""A client makes its same-host nodes' transports at connect (kvpool.cluster.client.warm_up).

The feature's proof runs real master and node processes; the best-effort edges
(a master without ``REGIONS``, a node elsewhere, a build that fails) run on a
stand-in session, as unit tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until
from poolhelpers import make_keys, payload

import kvpool
from kvpool.cluster.client.warm_up import TransportWarmUp
from kvpool.cluster.wire import REGIONS
from kvpool.errors import RemoteError, TransportUnavailableError
from kvpool.storage.arena import SharedArena
from kvpool.transport.base import RegionInfo, host_identity


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = start_cluster(["16MiB", "16MiB"])
    try:
        with kvpool.connect(cluster.url) as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, timeout=15)
        yield cluster
    finally:
        cluster.stop()


def _warm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvpool-warm-up"]


def test_a_client_maps_its_nodes_before_its_first_call(cluster: Cluster) -> None:
    with kvpool.connect(cluster.url) as pool:
        assert wait_until(lambda: pool.stats()["client"]["warmed_nodes"] == 2, timeout=15)
        shm = pool.stats()["transports"]["shm"]
        assert shm["peers"] == 2 and shm["bytes_read"] == shm["bytes_written"] == 0
        keys = make_keys(8)
        for i, key in enumerate(keys):  # blocks land on both nodes, through those transports
            assert pool.put(key, payload(i))
        out = np.empty_like(payload(0))
        for i, key in enumerate(keys):
            assert pool.get_into(key, out) == out.nbytes and np.array_equal(out, payload(i))
        shm = pool.stats()["transports"]["shm"]
        assert shm["peers"] == 2 and shm["bytes_read"] == 8 * out.nbytes
        for key in keys:
            pool.remove(key)


def _shm_mappings() -> int:
    """This process's mappings of /dev/shm files (node arenas, seal records)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if " /dev/shm/" in line)


def test_a_client_closed_at_once_leaves_nothing_running(cluster: Cluster) -> None:
    before = _shm_mappings()
    for _ in range(5):
        pool = kvpool.connect(cluster.url)
        pool.close()
        assert not _warm_threads()
        assert _shm_mappings() == before  # whatever the warm-up mapped is unmapped
    with kvpool.connect(cluster.url) as pool:  # warmed in full, then closed
        assert wait_until(lambda: pool.stats()["client"]["warmed_nodes"] == 2, timeout=15)
        assert _shm_mappings() > before
    assert _shm_mappings() == before
    with kvpool.connect(cluster.url) as pool:  # and the nodes serve the next client as before
        key = make_keys(1, seed=7)[0]
        assert pool.put(key, payload(1)) and pool.get(key) == payload(1).tobytes()
        pool.remove(key)


# --- the best-effort edges, on a stand-in session ----------------------------------


class _Control:
    def __init__(self) -> None:
        self.connected = False

    def connect_ahead(self) -> None:
        self.connected = True


class _Session:
    """What TransportWarmUp asks of a ClientSession, recorded."""

    def __init__(
        self, answer: dict[str, Any] | Exception, failing: frozenset[str] = frozenset()
    ) -> None:
        self.answer, self.failing = answer, failing
        self.regions: dict[str, RegionInfo] = {}
        self.closed = False
        self.rpc = self
        self.built: list[str] = []
        self.controls: dict[str, _Control] = {}

    def call(self, method: str) -> Any:
        assert method == REGIONS
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def learn(self, nodes: dict[str, RegionInfo]) -> None:
        self.regions.update(nodes)

    def transport(self, node_id: str) -> None:
        if node_id in self.failing:
            raise TransportUnavailableError(f"cannot map {node_id}")
        self.built.append(node_id)

    def control(self, node_id: str) -> _Control:
        return self.controls.setdefault(node_id, _Control())

    def seals(self, node_id: str) -> None:
        pass


@pytest.fixture
def arenas() -> Iterator[list[SharedArena]]:
    """Real /dev/shm arenas for the stand-in regions (``shm_reachable`` stats them)."""
    made: list[SharedArena] = []
    yield made
    for arena in made:
        arena.close()


def _region(arenas: list[SharedArena], node_id: str, here: bool) -> dict[str, Any]:
    arenas.append(SharedArena(4096))
    host_id = host_identity() if here else "another-host"
    return RegionInfo(node_id, 4096, host_id=host_id, shm_name=arenas[-1].name).to_dict()


def _warm(session: _Session) -> TransportWarmUp:
    warm_up = TransportWarmUp(session)  # type: ignore[arg-type]
    warm_up.close(5)  # the stand-in answers at once: the thread ends by itself
    assert not _warm_threads()
    return warm_up


def test_a_master_without_regions_leaves_it_to_the_first_call() -> None:
    warm_up = _warm(_Session(RemoteError("master", "unknown method nodes.regions")))
    assert warm_up.nodes == 0


def test_only_nodes_on_this_host_are_warmed(arenas: list[SharedArena]) -> None:
    here, far = _region(arenas, "here", True), _region(arenas, "far", False)
    session = _Session({"here": here, "far": far})
    warm_up = _warm(session)
    assert warm_up.nodes == 1 and session.built == ["here"]
    assert session.controls["here"].connected and "far" not in session.controls
    assert set(session.regions) == {"here", "far"}  # learned all the same


def test_a_node_that_cannot_be_mapped_is_skipped(arenas: list[SharedArena]) -> None:
    regions = {"a": _region(arenas, "a", True), "b": _region(arenas, "b", True)}
    session = _Session(regions, failing=frozenset({"a"}))
    warm_up = _warm(session)
    assert warm_up.nodes == 1 and session.built == ["b"]


def test_a_region_a_reply_named_already_is_kept(arenas: list[SharedArena]) -> None:
    """The warm-up's answer may be older than a put's reply: it must not undo it."""
    session = _Session({"a": _region(arenas, "a", True)})
    newer = RegionInfo("a", 8192, shm_name="newer")
    session.regions["a"] = newer
    _warm(session)
    assert session.regions["a"] is newer
