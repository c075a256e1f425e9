"""Replication with real processes: put(replicas=n), hot blocks, node loss, replicate()."""

from __future__ import annotations

import numpy as np
from clusterhelpers import start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload

import kvpool

HOT = ["--hot-reads", "4", "--cool-reads", "1", "--half-life", "0.4"]


def test_hot_block_gains_a_replica_then_cools_down() -> None:
    cluster = start_cluster(["4MiB", "4MiB", "4MiB"], *HOT)
    try:
        with kvpool.connect(cluster.url, timeout=5) as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 3, timeout=15)
            keys = make_keys(2)
            pool.put_batch(keys, [payload(0), payload(1)])
            assert [len(n) for n in pool.locate(keys)] == [1, 1]
            out = np.empty(BLOCK, np.uint8)
            with kvpool.connect(cluster.url) as reader:  # reads served from its lease cache
                for _ in range(6):
                    assert reader.get_into(keys[0], out) == BLOCK
            # ...are reported when it hands the lease back, so the next reader that
            # asks the master is told to copy the (now hot) block to another node.
            assert pool.get_into(keys[0], out) == BLOCK
            assert wait_until(lambda: len(pool.locate(keys)[0]) >= 2, timeout=5)
            assert len(pool.locate(keys)[1]) == 1  # the cold block stays single
            assert pool.stats()["client"]["replicas_added"] >= 1
            for _ in range(3):  # every replica serves the exact bytes
                assert pool.get_into(keys[0], out) == BLOCK
                assert np.array_equal(out, payload(0))
            assert wait_until(lambda: len(pool.locate(keys)[0]) == 1, timeout=10)
    finally:
        cluster.stop()


def test_a_replica_serves_when_the_other_node_dies() -> None:
    cluster = start_cluster(["4MiB", "4MiB"], "--no-auto-replicate")
    try:
        with kvpool.connect(cluster.url, timeout=3, transport="tcp") as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, timeout=15)
            keys = make_keys(8)
            assert pool.put_batch(keys, [payload(i) for i in range(8)], replicas=2) == [True] * 8
            assert all(len(set(n)) == 2 for n in pool.locate(keys))
            cluster.nodes[1].kill()
            out = np.empty(BLOCK, np.uint8)
            for i, key in enumerate(keys):  # before the master notices: fall back to the other
                assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=10)
            assert all(len(n) == 1 for n in pool.locate(keys))
            for i, key in enumerate(keys):
                assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))
    finally:
        cluster.stop()


def test_explicit_replicate_lands_on_the_chosen_node() -> None:
    cluster = start_cluster(["4MiB", "4MiB", "4MiB"], "--no-auto-replicate")
    try:
        with kvpool.connect(cluster.url, timeout=5) as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 3, timeout=15)
            keys = make_keys(4)
            pool.put_batch(keys, [payload(i) for i in range(4)])
            target = next(n for n in pool.stats()["nodes"] if n not in pool.locate(keys[:1])[0])
            holders_before = pool.locate(keys)
            expected = sum(target not in h for h in holders_before)
            assert pool.replicate(keys, node=target) == expected
            assert all(target in h for h in pool.locate(keys))
            assert pool.replicate(keys, node=target) == 0  # already there
            out = np.empty(BLOCK, np.uint8)
            for i, key in enumerate(keys):
                assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(i))
    finally:
        cluster.stop()
