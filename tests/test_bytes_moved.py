"""Bytes-moved accounting: every data server a node runs feeds kvpool_bytes_moved.

A real TCP data server (expose_region) and a real TcpTransport client move
bytes; the node's metric bookkeeping (Metrics.count_moved, fed from
ExposedRegion.served()) must report exactly those bytes per direction.
"""

from __future__ import annotations

import time

import numpy as np

from kvpool.bindings import stream_copy
from kvpool.cluster.metrics import Metrics
from kvpool.transport import shm_copy
from kvpool.transport.peers import PeerTransports, expose_region
from kvpool.transport.tcp import TcpTransport


def _moved(m: Metrics, transport: str, direction: str) -> float:
    got = m.registry.get_sample_value(
        "kvpool_bytes_moved_total", {"transport": transport, "direction": direction}
    )
    return got or 0.0


def _feed(m: Metrics, served: dict[str, tuple[int, int]]) -> None:
    for transport, (out, into) in served.items():
        m.count_moved(transport, "out", out)
        m.count_moved(transport, "in", into)


def test_tcp_bytes_are_counted_per_direction() -> None:
    region = np.zeros(1 << 20, np.uint8)
    exposed = expose_region(region, node_id="n", ucx=False)
    metrics = Metrics("node")
    try:
        with TcpTransport(exposed.info) as t:
            t.write(0, np.ones(5000, np.uint8))
            t.read_into(0, np.empty(3000, np.uint8))
            t.read_many([(0, np.empty(100, np.uint8)), (4096, np.empty(200, np.uint8))])
        assert set(exposed.served()) == {"tcp"}  # no UCX server was started
        # The server counts a reply just after sending it: wait for the last one.
        deadline = time.monotonic() + 10
        while exposed.served()["tcp"] != (3300, 5000) and time.monotonic() < deadline:
            time.sleep(0.01)
        _feed(metrics, exposed.served())
        _feed(metrics, exposed.served())  # feeding the same totals again adds nothing
        assert _moved(metrics, "tcp", "out") == 3300
        assert _moved(metrics, "tcp", "in") == 5000
    finally:
        exposed.close()


def test_a_restarted_server_counts_from_zero_again() -> None:
    metrics = Metrics("node")
    _feed(metrics, {"tcp": (100, 10), "ucx": (7, 0)})
    _feed(metrics, {"tcp": (40, 10), "ucx": (9, 0)})  # tcp server restarted: 40 new bytes
    assert _moved(metrics, "tcp", "out") == 140
    assert _moved(metrics, "ucx", "out") == 9
    assert _moved(metrics, "tcp", "in") == 10


def test_same_host_bytes_are_counted_by_the_client() -> None:
    """shm copies never pass through the node: the client's transports count them."""
    from kvpool.storage.arena import SharedArena

    arena = SharedArena(1 << 20)
    exposed = expose_region(arena.view, node_id="n", shm_name=arena.name, ucx=False)
    peers = PeerTransports()
    try:
        t = peers.get(exposed.info)
        assert t.name == "shm"
        t.write(0, np.ones(4096, np.uint8))
        t.read_into(0, np.empty(1024, np.uint8))
        assert peers.stats()["shm"] == {
            "bytes_read": 1024,
            "bytes_written": 4096,
            "peers": 1,
            "page_lock": {"n": "not yet: no GPU buffer copied"},  # host buffers only
            "copy": stream_copy.status(),
            "checked_copy": shm_copy.STATUS,
        }
        assert exposed.served() == {"tcp": (0, 0)}
    finally:
        peers.close()
        exposed.close()
        arena.close()
