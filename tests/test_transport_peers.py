"""expose_region (node side) and PeerTransports (client side) in one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.errors import PoolClosedError, TransportUnavailableError
from kvpool.storage.arena import SharedArena
from kvpool.transport import peers as peers_module
from kvpool.transport import tcp_congestion, tcp_recv
from kvpool.transport.base import RegionInfo
from kvpool.transport.peers import PeerTransports, advertised_host, expose_region


def test_expose_and_peers() -> None:
    arena = SharedArena(1 << 20)
    exposed = expose_region(arena.view, node_id="n1", shm_name=arena.name, ucx=False)
    try:
        info = RegionInfo.from_dict(exposed.info.to_dict())  # as it travels via the master
        assert info.size == 1 << 20 and info.tcp_host == "127.0.0.1"
        data = np.arange(1000, dtype=np.uint8)
        peers = PeerTransports()
        assert peers.get(info).name == "shm" and peers.get(info) is peers.get(info)
        peers.get(info).write(100, data)
        tcp_peers = PeerTransports(override="tcp")
        out = np.empty(1000, np.uint8)
        tcp_peers.get(info).read_into(100, out)
        assert np.array_equal(out, data)
        tcp_peers.drop("n1")
        tcp_peers.get(info).read_into(100, out)  # reconnects
        tcp_stats = tcp_peers.stats()["tcp"]
        assert tcp_stats.pop("spin")["status"] == tcp_recv.STATUS  # how its receives wait
        assert tcp_stats.pop("congestion") == tcp_congestion.CHOSEN.status()
        assert tcp_stats == {"bytes_read": 2000, "bytes_written": 0, "peers": 1}
        assert peers.stats()["shm"]["bytes_written"] == 1000
        moved = RegionInfo.from_dict({**info.to_dict(), "tcp_port": info.tcp_port})
        moved.shm_name = ""  # a re-registered node with other details gets a fresh transport
        assert peers.get(moved).name == "tcp"
        assert peers.stats()["shm"]["bytes_written"] == 1000  # retired counters kept
        peers.close()
        tcp_peers.close()
    finally:
        exposed.close()
        arena.close()


def test_advertised_host() -> None:
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0") not in ("", "0.0.0.0")


#: a node's region as the tests below ask for it (nothing listens there: builds are faked)
NODE = RegionInfo(node_id="n1", size=1 << 20, host_id="h", tcp_host="127.0.0.1", tcp_port=1)


class _Built:
    """A stand-in transport: what ``select_transport`` returns in the tests below."""

    name = "fake"
    bytes_read = bytes_written = 0

    def __init__(self, info: RegionInfo) -> None:
        self.info = info
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _held_builds(
    built: list[_Built], release: threading.Event, started: threading.Event | None = None
) -> Callable[..., _Built]:
    """A ``select_transport`` stand-in: each build sets ``started``, waits for
    ``release``, then records the transport it returns in ``built``."""

    def build(info: RegionInfo, *args: object, **kwargs: object) -> _Built:
        if started is not None:
            started.set()
        release.wait(5)
        built.append(_Built(info))
        return built[-1]

    return build


def test_one_thread_builds_a_nodes_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads asking for a node's transport at once share one build (a client's
    first put and its claim thread each mapped and pre-faulted the whole arena)."""
    builds: list[_Built] = []
    release = threading.Event()
    monkeypatch.setattr(peers_module, "select_transport", _held_builds(builds, release))
    peers = PeerTransports()
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(peers.get(NODE))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)  # by now one builds and three wait (a later one takes the built one)
    release.set()
    for t in threads:
        t.join(5)
    assert len(builds) == 1 and got == [builds[0]] * 4 and not builds[0].closed
    moved = RegionInfo.from_dict({**NODE.to_dict(), "tcp_port": 2})  # the node restarted
    assert peers.get(moved) is builds[1] and builds[0].closed  # the old one retired


def test_a_failed_build_leaves_the_next_ask_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def build(info: RegionInfo, *args: object, **kwargs: object) -> _Built:
        calls.append(1)
        if len(calls) == 1:
            raise TransportUnavailableError("node not reachable yet")
        return _Built(info)

    monkeypatch.setattr(peers_module, "select_transport", build)
    peers = PeerTransports()
    with pytest.raises(TransportUnavailableError):
        peers.get(NODE)
    assert peers.get(NODE) is peers.get(NODE) and len(calls) == 2


def test_a_build_that_ends_after_close_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transport still being built when close() runs (a client's warm-up thread,
    kvpool.cluster.client.warm_up) is closed, not kept: nothing outlives close()."""
    built: list[_Built] = []
    building, release = threading.Event(), threading.Event()
    monkeypatch.setattr(peers_module, "select_transport", _held_builds(built, release, building))
    peers = PeerTransports()
    raised: list[BaseException] = []

    def ask() -> None:
        try:
            peers.get(NODE)
        except PoolClosedError as exc:
            raised.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    assert building.wait(5)
    peers.close()
    release.set()
    asker.join(5)
    assert len(built) == 1 and built[0].closed and len(raised) == 1
    with pytest.raises(PoolClosedError):
        peers.get(NODE)
    assert peers.stats() == {}
