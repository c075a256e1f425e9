"""A put cut in two by a master restart, at the two instants that used to make it
answer without a block behind the key (real master and node processes; the
restart is made to happen at the instant by wrapping the client's own calls).

The store contract: once ``put`` returns, True or False, the key holds a block.
Seen in CI's HA storm (2026-12-02): a put whose node started a new master term
between its claim and its seal, or whose commit reached the new master, answered
False and nothing was stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until

import kvpool
from kvpool.cluster.wire import COMMIT

BLOCK = 256 << 10


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(4100 + i).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["8MiB", "8MiB"])
    yield c
    c.stop()


def restart_and_wait_for_nodes(cluster: Cluster) -> None:
    """Kill -9 the master, start a new one, and wait until both nodes registered
    with it (a new term: every claim not yet sealed is aborted)."""
    cluster.restart_master()
    with kvpool.connect(cluster.url, timeout=10) as probe:
        assert wait_until(lambda: len(probe.stats()["nodes"]) == 2, timeout=15)


def read_back(pool: kvpool.RemotePool, key: bytes, data: np.ndarray) -> bool:
    out = np.empty(BLOCK, np.uint8)
    return pool.get_into(key, out) == BLOCK and np.array_equal(out, data)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_seal_refused_by_a_new_term_is_retried(cluster: Cluster, replicas: int) -> None:
    """Same-host put (claim, copy, seal): the master restarts after the copy, so
    the node aborts the claim and refuses the seal. The put retries on the new
    master and answers True; the block reads back, also after another restart."""
    key = b"\x51" * 16
    with kvpool.connect(cluster.url, timeout=10, put_grant_bytes=0) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, timeout=15)
        session = pool._session
        real = session.transport
        cut: list[str] = []

        class CutAfterCopy:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

            def write_many(self, plan: list) -> None:
                self.inner.write_many(plan)
                if not cut:
                    cut.append("restarted")
                    restart_and_wait_for_nodes(cluster)

        session.transport = lambda node_id: CutAfterCopy(real(node_id))  # type: ignore[method-assign]
        try:
            assert pool.put(key, payload(1), replicas=replicas) is True
        finally:
            session.transport = real  # type: ignore[method-assign]
        assert cut == ["restarted"]
        assert read_back(pool, key, payload(1))
        cluster.restart_master()  # the retried block was sealed: its node re-registers it
        assert wait_until(lambda: pool.exists([key]) == [True], timeout=15)
        assert read_back(pool, key, payload(1))


def test_a_commit_that_reaches_the_new_master_still_answers_true(cluster: Cluster) -> None:
    """Synchronous commit (replicas=2, TCP writes: whole at the ack): the master
    restarts between the writes and the commit, so the new master does not know
    the allocations (False). The nodes re-registered the written block, so the
    put answers True and the bytes read back."""
    key = b"\x52" * 16
    with kvpool.connect(cluster.url, timeout=10, transport="tcp", put_grant_bytes=0) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 2, timeout=15)
        link = pool._session.rpc
        real = link.call
        commits: list[Any] = []

        def call(method: str, *args: Any, **kwargs: Any) -> Any:
            if method == COMMIT and not commits:
                restart_and_wait_for_nodes(cluster)
                commits.append(real(method, *args, **kwargs))
                return commits[0]
            return real(method, *args, **kwargs)

        link.call = call  # type: ignore[method-assign]
        try:
            assert pool.put(key, payload(2), replicas=2) is True
        finally:
            link.call = real  # type: ignore[method-assign]
        # The new master never lent them (one per replica written: under load a
        # replica's write can fail and be left out, which the put tolerates).
        assert len(commits) == 1 and commits[0] and not any(commits[0])
        assert read_back(pool, key, payload(2))
