"""expose_region (node side) and PeerTransports (client side) in one process."""

from __future__ import annotations

import numpy as np

from kvpool.storage.arena import SharedArena
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
