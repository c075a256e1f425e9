"""The election loop on the in-memory coordinator (the real-etcd proofs are in test_ha.py)."""

from __future__ import annotations

import threading
import time

import pytest
from clusterhelpers import wait_until

from kvpool.cluster.ha import Election, ElectionConfig, MemoryCoordinator
from kvpool.cluster.ha.coordinator import MemoryStore
from kvpool.cluster.link import MasterLink, parse_masters
from kvpool.errors import ConnectionLostError, PoolClosedError, StaleEpochError

CFG = ElectionConfig(cluster="t", ttl=1.0, poll_s=0.05)


class Member:
    def __init__(self, store: MemoryStore, name: str) -> None:
        self.terms: list[int] = []
        self.deposed = 0
        self.election = Election(
            MemoryCoordinator(store), name, CFG, self.terms.append, self._deposed
        )

    def _deposed(self) -> None:
        self.deposed += 1


def test_one_leader_standbys_know_it_and_take_over() -> None:
    store = MemoryStore()
    members = [Member(store, f"m{i}:1") for i in range(3)]
    for m in members:
        m.election.start()
    try:
        assert wait_until(lambda: sum(m.election.serving() for m in members) == 1, 5)
        leader = next(m for m in members if m.election.serving())
        assert wait_until(lambda: all(m.election.leader == leader.election.me for m in members), 5)
        first = leader.terms[-1]
        leader.election.close()  # resigns
        assert wait_until(
            lambda: sum(m.election.serving() for m in members if m is not leader) == 1, 5
        )
        second = next(m for m in members if m.election.serving())
        assert second.terms[-1] > first
    finally:
        for m in members:
            m.election.close()


def test_a_leader_that_cannot_renew_stops_serving_before_its_lease_expires() -> None:
    store = MemoryStore()
    m = Member(store, "m:1")
    m.election.start()
    try:
        assert wait_until(m.election.serving, 5)
        store.down = True
        t0 = time.monotonic()
        assert wait_until(lambda: not m.election.serving(), 5, interval=0.01)
        assert time.monotonic() - t0 < CFG.ttl  # fenced inside the TTL
        assert wait_until(lambda: m.deposed == 1, 5)
        store.down = False
        assert wait_until(m.election.serving, 5)  # elected again, in a newer term
        assert m.terms[1] > m.terms[0]
    finally:
        m.election.close()


def test_election_config_is_checked() -> None:
    with pytest.raises(ValueError, match="TTL"):
        Election(
            MemoryCoordinator(MemoryStore()),
            "m",
            ElectionConfig(ttl=0.5),
            lambda e: None,
            lambda: None,
        )


def test_master_addresses_and_terms_seen_by_a_link() -> None:
    assert parse_masters("a:1, b:2,") == [("a", 1), ("b", 2)]
    assert parse_masters(("a", 1)) == [("a", 1)]
    with pytest.raises(ValueError):
        parse_masters(",")
    link = MasterLink("127.0.0.1:9", connect=False)
    link.saw_epoch(5)
    link.saw_epoch(7)
    with pytest.raises(StaleEpochError):
        link.saw_epoch(6)  # a deposed master's reply


def test_a_closed_link_stops_retrying_and_never_reconnects() -> None:
    """A call waiting out a failover (no master answers) ends at its next attempt
    once the link closes, instead of holding a closing client for the deadline;
    nothing connects afterwards."""
    link = MasterLink("127.0.0.1:9", connect=False, deadline=60.0)  # nothing listens
    raised: list[BaseException] = []

    def call() -> None:
        try:
            link.call("stats")
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.2)  # a few refused attempts in
    closed_at = time.monotonic()
    link.close()
    caller.join(10)
    assert not caller.is_alive() and time.monotonic() - closed_at < 5
    assert len(raised) == 1 and isinstance(raised[0], PoolClosedError)
    with pytest.raises(ConnectionLostError, match="closed"):
        link.submit("stats")


def test_a_term_is_served_only_after_it_was_set_up() -> None:
    """``serving()`` is False while ``on_elected`` runs (the master resets its catalog
    for the term there): a call that passed the gate earlier would have allocated on
    an empty catalog past its start-up grace and answered "pool full" (seen in CI
    under a leader-kill storm)."""
    seen: list[bool] = []

    def elected(epoch: int) -> None:
        seen.append(election.serving())  # bound by the time the election thread calls

    election = Election(MemoryCoordinator(MemoryStore()), "m:1", CFG, elected, lambda: None)
    election.start()
    try:
        assert wait_until(election.serving, 5)
        assert seen == [False]
        assert election.leader == "m:1"
    finally:
        election.close()
