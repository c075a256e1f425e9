"""Storage nodes with an SSD tier: demotion ahead of eviction, promotion on read, restarts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from clusterhelpers import Cluster, spawn, start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload

import kvpool
from kvpool import RemotePool
from kvpool.cluster.client.lease_replies import BUSY_WAIT_S


@pytest.fixture
def ssd_cluster(tmp_path: object) -> Iterator[tuple[Cluster, str]]:
    cluster = start_cluster([])
    ssd_dir = f"{tmp_path}/ssd"
    cluster.add_node("4MiB", "--ssd", ssd_dir, "--ssd-size", "32MiB")  # 64 + 512 blocks
    yield cluster, ssd_dir
    cluster.stop()


def node_stats(pool: RemotePool) -> dict:
    (stats,) = pool.stats()["nodes"].values()
    return stats


def fill_and_demote(pool: RemotePool, keys: list[bytes]) -> None:
    """Put in waves, letting the master's cleaner copy cold blocks to SSD between them."""
    for start in range(0, len(keys), 32):
        wave = keys[start : start + 32]
        pool.put_batch(wave, [payload(start + i) for i in range(len(wave))])
        want = start + len(wave)  # the cleaner writes every block behind
        assert wait_until(lambda w=want: node_stats(pool)["ssd_blocks"] >= w, timeout=10)


def test_evicted_blocks_live_on_in_the_ssd_tier(ssd_cluster: tuple[Cluster, str]) -> None:
    cluster, _ = ssd_cluster
    # No grants: a client's stock of keyless grants holds (and evicts for) DRAM
    # ranges, so with grants on the committed count below is 64 minus whatever
    # stock happens to be outstanding when stats are read.
    with kvpool.connect(cluster.url, timeout=10, put_grant_bytes=0) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        keys = make_keys(192)  # three times the node's DRAM
        fill_and_demote(pool, keys)
        assert pool.prefix_match(keys) == 192
        assert node_stats(pool)["blocks"] == 64  # DRAM holds 64 at a time
        out = np.empty(BLOCK, np.uint8)
        for i in range(192):  # old ones are promoted back from SSD on the way
            assert pool.get_into(keys[i], out) == BLOCK, i
            assert np.array_equal(out, payload(i)), i


@pytest.mark.parametrize("freed_after", [0.3, None])
def test_a_read_waits_a_bounded_time_for_dram_room_to_promote_into(
    ssd_cluster: tuple[Cluster, str], freed_after: float | None
) -> None:
    """Another client leases every block in DRAM, so reading an SSD-only block finds
    no room to promote it into (``busy``). The read waits: when that lease is
    released 0.3 s later it succeeds; when it never is, it misses after
    ``BUSY_WAIT_S``, not sooner and not much later."""
    cluster, _ = ssd_cluster
    with (
        kvpool.connect(cluster.url, timeout=10, put_grant_bytes=0) as pool,
        kvpool.connect(cluster.url, timeout=10, lease_cache_s=0) as holder,  # release: at once
    ):
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        keys = make_keys(128)
        fill_and_demote(pool, keys)
        assert node_stats(pool)["blocks"] == 64  # DRAM full: the newest 64
        held = holder.lease(keys[64:])
        assert len(held.keys) == 64  # every DRAM block leased (promotions included)
        timer = None if freed_after is None else threading.Timer(freed_after, held.release)
        out = np.empty(BLOCK, np.uint8)
        try:
            if timer is not None:
                timer.start()
            started = time.monotonic()
            got = pool.get_into(keys[0], out)  # SSD-only: must be promoted first
            waited = time.monotonic() - started
        finally:
            if timer is not None:
                timer.join()
            else:
                held.release()
        assert pool.stats()["client"]["lease_busy_retries"] >= 1
        if freed_after is None:
            assert got is None and BUSY_WAIT_S <= waited < BUSY_WAIT_S + 2.0
            assert pool.get_into(keys[0], out) == BLOCK  # room now: promoted and read
        else:
            assert got == BLOCK and freed_after <= waited < BUSY_WAIT_S
        assert np.array_equal(out, payload(0))


def test_ssd_blocks_survive_a_node_restart(ssd_cluster: tuple[Cluster, str]) -> None:
    cluster, ssd_dir = ssd_cluster
    with kvpool.connect(cluster.url, timeout=10) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        keys = make_keys(96)
        fill_and_demote(pool, keys)
        on_ssd = node_stats(pool)["ssd_blocks"]
        assert on_ssd >= 32
        cluster.nodes[0].kill()  # kill -9: its DRAM is gone, its SSD is not
        assert wait_until(lambda: not pool.stats()["nodes"], timeout=10)
        cluster.nodes[0] = spawn(
            [
                "node",
                "--master",
                cluster.master.address,
                "--dram",
                "4MiB",
                "--ssd",
                ssd_dir,
                "--ssd-size",
                "32MiB",
                "--heartbeat",
                "0.2",
            ]
        )
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        present = [i for i, ok in enumerate(pool.exists(keys)) if ok]
        assert len(present) == on_ssd
        out = np.empty(BLOCK, np.uint8)
        for i in present:
            assert pool.get_into(keys[i], out) == BLOCK and np.array_equal(out, payload(i))


def test_master_restart_restores_ssd_blocks(ssd_cluster: tuple[Cluster, str]) -> None:
    cluster, _ = ssd_cluster
    with kvpool.connect(cluster.url, timeout=10) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        keys = make_keys(128)
        fill_and_demote(pool, keys)
        assert pool.prefix_match(keys) == 128
        cluster.restart_master()
        assert wait_until(lambda: pool.stats()["blocks"] == 128, timeout=15)
        out = np.empty(BLOCK, np.uint8)
        # For the re-join grace the new term keeps the re-registered DRAM blocks
        # (readers of the old term may still copy them), so a promotion from SSD
        # that needs their room waits: a miss, not wrong bytes.
        for i in (0, 50, 127):
            assert wait_until(lambda i=i: pool.get_into(keys[i], out) == BLOCK, timeout=10)
            assert np.array_equal(out, payload(i))
