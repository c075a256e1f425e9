"""The pool over UCX with real master and node processes (skipped where ucxx is
not installed: ``pip install 'kvpool[ucx]'``).

Nodes serve UCX because ``KVPOOL_UCX=on`` (no RDMA device here: UCX runs over
TCP on loopback) and a token (UCXX 0.52's listener binds every interface).
The clients pick UCX with ``transport="ucx"``. What runs: puts (bytes over
UCX, claimed and sealed on the node's TCP port), checked gets, a stale writer
after a master restart (refused), acknowledged puts surviving a master kill.
The outdated-lease read over UCX is a case of tests/test_failover_standalone.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from clusterhelpers import start_cluster, wait_until

import kvpool
from kvpool.errors import PoolFullError, StaleWriteError

pytest.importorskip("ucxx", reason="ucxx not installed (pip install 'kvpool[ucx]')")

MIB = 1 << 20


@pytest.fixture(autouse=True)
def ucx_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes (child processes inherit the environment) serve UCX, with a token."""
    monkeypatch.setenv("KVPOOL_UCX", "on")
    monkeypatch.setenv("KVPOOL_TOKEN", "ucx-cluster-token")


def payload(i: int, size: int = MIB) -> np.ndarray:
    return np.random.default_rng(2000 + i).integers(0, 256, size, dtype=np.uint8)


def test_puts_and_gets_over_ucx_with_a_master_kill() -> None:
    cluster = start_cluster(["16MiB", "16MiB"])
    try:
        with kvpool.connect(cluster.url, timeout=5, transport="ucx") as pool:
            keys = [bytes([i]) * 16 for i in range(10)]
            for i, key in enumerate(keys):
                assert pool.put(key, payload(i))
            cluster.restart_master()  # right after the last ack
            out = np.empty(MIB, np.uint8)

            def all_back() -> bool:
                return all(
                    pool.get_into(key, out) == MIB and np.array_equal(out, payload(i))
                    for i, key in enumerate(keys)
                )

            assert wait_until(all_back, timeout=20)
            batch = [np.empty(MIB, np.uint8) for _ in keys]
            assert pool.get_into_batch(keys, batch) == [MIB] * len(keys)
            assert all(np.array_equal(b, payload(i)) for i, b in enumerate(batch))
            assert pool.stats()["transport"] == "ucx"
    finally:
        cluster.stop()


def test_a_stale_ucx_writer_is_fenced_after_a_restart() -> None:
    """Hold a reservation (pieces written over UCX), restart the master, let the
    new term give the same space to another client, resume the first writer: it
    is refused, and the other block reads back exactly."""
    cluster = start_cluster(["1MiB"])
    try:
        first = kvpool.connect(cluster.url, timeout=5, transport="ucx")
        other = kvpool.connect(cluster.url, timeout=5, transport="ucx")
        k1, k2 = b"\x51" * 16, b"\x52" * 16
        writer = first.reserve(k1, MIB)
        assert writer is not None
        writer.write(0, payload(1)[: MIB // 2])
        cluster.restart_master()
        assert wait_until(lambda: _put(other, k2, payload(2)), timeout=15)
        with pytest.raises(StaleWriteError):
            writer.write(MIB // 2, payload(1)[MIB // 2 :])
        with pytest.raises(StaleWriteError):
            writer.commit()
        out = np.empty(MIB, np.uint8)
        assert other.get_into(k2, out) == MIB and np.array_equal(out, payload(2))
        assert not first.exists([k1])[0]
        assert first.stats()["transport"] == "ucx"
        first.close()
        other.close()
    finally:
        cluster.stop()


def _put(pool: kvpool.RemotePool, key: bytes, data: np.ndarray) -> bool:
    try:
        return pool.put(key, data)
    except PoolFullError:
        return False
