"""Put grants: space granted before the key, so a put costs one master round trip.

Unit tests of the client's grant stock, then a real master and nodes (separate
processes) with clients that put through grants, lose them, and give them back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
from clusterhelpers import Cluster, start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload

import kvpool
from kvpool.cluster.client.claims import GrantClaims
from kvpool.cluster.client.fenced import OK
from kvpool.cluster.client.grants import (
    BASE_STOCK,
    MAX_STOCK,
    Grant,
    GrantStock,
    grant_budget,
)
from kvpool.cluster.client.remote_pool import RemotePool
from kvpool.cluster.master import MasterConfig
from kvpool.cluster.wire import ALLOCATE, COMMIT, REVOKE, AllocateRequest, CommitRequest, IdsRequest
from kvpool.errors import ConnectionLostError, InvalidKeyError, PutFailedError, RemoteError
from kvpool.rpc.client import RpcClient

DRAM = 8 << 20  # per node: 128 blocks of 64 KiB; the master lends 1/16 of 16 MiB


def grant(alloc_id: int, node: str = "n1", expires_in: float = 10.0) -> Grant:
    return Grant(alloc_id, node, alloc_id * BLOCK, None, time.monotonic() + expires_in)


def test_stock_hands_out_fresh_grants_once_in_order() -> None:
    stock = GrantStock(budget_bytes=4 * BLOCK)
    assert stock.target(BLOCK) == 4 and stock.target(1) == BASE_STOCK
    stock.add(BLOCK, [grant(1, expires_in=-1), grant(2), grant(3)])
    assert stock.take(2 * BLOCK) is None  # another size
    assert [stock.take(BLOCK).alloc_id, stock.take(BLOCK).alloc_id] == [2, 3]  # type: ignore[union-attr]
    assert stock.take(BLOCK) is None and stock.used == 2


def test_stock_refills_at_half_and_only_once_at_a_time() -> None:
    stock = GrantStock(budget_bytes=4 * BLOCK)
    assert stock.wants_refill(BLOCK) == 4
    fut: Future[object] = Future()
    stock.refilling(BLOCK, fut, lambda f: stock.add(BLOCK, [grant(7), grant(8), grant(9)], f))
    assert stock.wants_refill(BLOCK) == 0  # one refill in flight
    fut.set_result(None)
    assert len(stock) == 3 and stock.wants_refill(BLOCK) == 0  # above half
    stock.take(BLOCK)
    assert stock.wants_refill(BLOCK) == 0  # 2 left: above half of the 3 it reached
    stock.take(BLOCK)
    assert stock.wants_refill(BLOCK) == 3
    assert GrantStock(0).wants_refill(BLOCK) == 0  # grants off


class _Control:
    """A node's control connection that answers every claim OK, or fails a chunk."""

    def __init__(self, fail_at: int = -1) -> None:
        self.chunks: list[int] = []
        self.fail_at = fail_at

    def stamped(self, items: list[tuple[int, bytes, int, None]]) -> list[int]:
        if len(self.chunks) == self.fail_at:
            self.chunks.append(len(items))
            raise ConnectionLostError("the node went away")
        self.chunks.append(len(items))
        return [OK] * len(items)


class _Session:
    """What ``GrantClaims`` asks of a client session: a same-host node "n1"."""

    def __init__(self, control: _Control) -> None:
        self.regions = {"n1": object()}
        self._control = control

    def transport(self, node_id: str) -> object:
        return object()  # not a TcpTransport: claims are taken ahead

    def control(self, node_id: str) -> _Control:
        return self._control


@pytest.mark.parametrize(
    ("fail_at", "chunks", "claimed"), [(-1, [32, 64, 4], 100), (1, [32, 64], 32)]
)
def test_claims_go_oldest_first_in_growing_chunks(
    fail_at: int, chunks: list[int], claimed: int
) -> None:
    """A refill's grants are claimed 32 first, then twice as many each exchange (so
    the oldest, which the straight path takes next, are usable early); a chunk that
    fails ends the claiming, and its grants and the rest are left unclaimed (not
    stuck as being claimed: the next ``to_claim`` offers them again)."""
    stock = GrantStock()
    stock.add(BLOCK, [grant(i) for i in range(1, 101)])
    control = _Control(fail_at)
    claims = GrantClaims(_Session(control), stock)  # type: ignore[arg-type]
    claims.claim_soon()
    claims.close()  # waits for the claiming
    assert control.chunks == chunks
    assert stock.claimed_in_stock() == claimed
    assert [g.alloc_id for g, _ in stock.to_claim()] == list(range(claimed + 1, 101))


def test_a_stock_deepens_when_its_refill_comes_too_late_once_per_refill() -> None:
    """A put that finds no grant while the refill meant for it is on its way doubles
    the size's depth (the refill came too late at this client's pace); the puts after
    it until that refill lands do not; the next late refill doubles it again."""
    stock = GrantStock()
    assert stock.target(BLOCK) == BASE_STOCK and stock.counters()["put_grant_depths"] == {}
    stock.add(BLOCK, [grant(1)])
    fut: Future[object] = Future()
    stock.refilling(BLOCK, fut, lambda f: stock.add(BLOCK, [grant(i) for i in range(2, 9)], f))
    assert stock.take(BLOCK) is not None
    assert stock.take(BLOCK) is None and stock.target(BLOCK) == 2 * BASE_STOCK
    assert stock.take_claimed(BLOCK) is None and stock.oldest(BLOCK) is None
    assert stock.target(BLOCK) == 2 * BASE_STOCK  # once per refill
    fut.set_result(None)  # lands: the next late one may deepen again
    while stock.take(BLOCK) is not None:
        pass
    later: Future[object] = Future()
    stock.refilling(BLOCK, later, lambda f: stock.add(BLOCK, [], f))
    assert stock.oldest(BLOCK) is None
    assert stock.counters()["put_grant_depths"] == {BLOCK: 4 * BASE_STOCK}


def test_a_stock_deepens_when_its_oldest_grants_claim_is_on_its_way() -> None:
    stock = GrantStock()
    stock.add(BLOCK, [grant(1), grant(2)])
    assert stock.take_claimed(BLOCK) is None  # not claimed, nor being claimed: no signal
    assert stock.target(BLOCK) == BASE_STOCK
    claiming = stock.to_claim()  # the claim thread sends them now
    assert stock.take_claimed(BLOCK) is None and stock.target(BLOCK) == 2 * BASE_STOCK
    assert stock.claimed(claiming, [True, True]) == []
    assert stock.take_claimed(BLOCK) is not None


def test_a_stock_does_not_deepen_when_nothing_was_on_its_way() -> None:
    """An empty stock with no refill coming (the master lent none, or grants are off
    at this size) is not a pace problem: deeper would not help."""
    stock = GrantStock()
    assert stock.take(BLOCK) is None and stock.take_claimed(BLOCK) is None
    assert stock.oldest(BLOCK) is None and stock.counters()["put_grant_depths"] == {}


def test_a_stock_depth_stays_within_its_cap_and_budget_and_halves_when_grants_expire() -> None:
    stock = GrantStock()
    for _ in range(10):  # ten late refills
        fut: Future[object] = Future()
        stock.refilling(BLOCK, fut, lambda f: stock.add(BLOCK, [], f))
        assert stock.take(BLOCK) is None
        fut.set_result(None)
    assert stock.target(BLOCK) == MAX_STOCK
    small = GrantStock(budget_bytes=100 * BLOCK)
    fut = Future()
    small.refilling(BLOCK, fut, lambda f: small.add(BLOCK, [], f))
    small.take(BLOCK)
    assert small.target(BLOCK) == 100  # the budget holds (128 asked)
    stock.add(BLOCK, [grant(1, expires_in=-1), grant(2)])
    assert stock.stale() == [1] and stock.target(BLOCK) == MAX_STOCK // 2  # a slower client
    assert stock.take(BLOCK) is not None  # grant 2
    for alloc_id in range(3, 10):
        stock.add(BLOCK, [grant(alloc_id, expires_in=-1)])
        stock.stale()
    assert stock.target(BLOCK) == BASE_STOCK  # never below where it started


def test_stock_gives_back_dropped_stale_and_remaining_grants() -> None:
    stock = GrantStock()
    stock.add(BLOCK, [grant(1, "a"), grant(2, "b"), grant(3, "a", expires_in=-1)])
    stock.forget_node("a")
    assert sorted(stock.stale()) == [1, 3] and len(stock) == 1
    assert stock.drain() == [2] and len(stock) == 0 and stock.stale() == []


def test_a_grant_too_old_to_take_is_handed_back_with_its_claim() -> None:
    """``take`` skips a grant past its use window; ``stale`` then returns it, so the
    janitor releases its claim on the node and revokes it. (Dropped silently, its
    claim held the range for good: after a master restart made puts wait past their
    grants' window, every later allocation there failed BUSY.)"""
    stock = GrantStock()
    stock.add(BLOCK, [grant(1, expires_in=0.05), grant(2)])
    claiming = stock.to_claim()
    assert [g.alloc_id for g, _ in claiming] == [1, 2]
    assert stock.claimed(claiming, [True, True], at_ns=5) == []
    time.sleep(0.06)
    taken = stock.take(BLOCK)
    assert taken is not None and taken.alloc_id == 2 and stock.was_claimed(2) == 5
    assert stock.stale() == [1]
    assert [(g.alloc_id, size) for g, size in stock.claims_of([1])] == [(1, BLOCK)]
    assert stock.stale() == [] and len(stock) == 0


def test_take_claimed_takes_only_the_oldest_grant_holding_its_claim() -> None:
    """The sealed put's straight path: ``take_claimed`` takes the oldest grant only
    when it is fresh and claimed (with the claim's clock, 1 if unknown, and whether a
    refill is due), else takes nothing; ``put_back`` makes it the oldest again with
    its claim, so the general path's ``take`` gets the same grant next."""
    stock = GrantStock(budget_bytes=4 * BLOCK)
    stock.add(BLOCK, [grant(1), grant(2), grant(3), grant(4)])
    assert stock.take_claimed(BLOCK) is None  # nothing claimed yet
    claiming = stock.to_claim()
    assert stock.claimed(claiming[:1], [True], at_ns=0) == []  # grant 1: clock unknown
    assert stock.claimed(claiming[1:2], [False]) == []  # grant 2: its claim failed
    assert stock.claimed(claiming[2:], [True, True], at_ns=9) == []
    taken = stock.take_claimed(BLOCK)
    assert taken is not None and taken[0].alloc_id == 1 and taken[1:] == (1, False)
    assert stock.take_claimed(BLOCK) is None and len(stock) == 3  # 2 is not claimed: left
    stock.put_back(taken[0], BLOCK, taken[1])
    assert stock.used == 0 and len(stock) == 4
    again = stock.take(BLOCK)
    assert again is taken[0] and stock.was_claimed(1) == 1  # the same grant, its claim kept
    assert stock.take(BLOCK).alloc_id == 2 and stock.was_claimed(2) == 0  # type: ignore[union-attr]
    taken = stock.take_claimed(BLOCK)  # 1 left after it: at half of 4, a refill is due
    assert taken is not None and taken[0].alloc_id == 3 and taken[1:] == (9, True)
    assert stock.take_claimed(2 * BLOCK) is None  # another size


def test_take_claimed_leaves_a_grant_too_old_to_use_with_its_claim() -> None:
    stock = GrantStock()
    stock.add(BLOCK, [grant(1, expires_in=-1), grant(2)])
    assert stock.claimed(stock.to_claim(), [True, True], at_ns=5) == []
    assert stock.take_claimed(BLOCK) is None and len(stock) == 2
    assert stock.stale() == [1]  # the janitor releases its claim and revokes it
    assert [g.alloc_id for g, _ in stock.claims_of([1])] == [1]


def test_take_claimed_waits_for_a_claim_on_its_way() -> None:
    """With ``wait_s``, a put that finds its oldest grant's claim on the way waits for
    it (the lock released) instead of going the general way; no longer than asked."""
    stock = GrantStock()
    stock.add(BLOCK, [grant(1), grant(2)])
    claiming = stock.to_claim()
    started = time.monotonic()
    assert stock.take_claimed(BLOCK, wait_s=0.05) is None  # nothing lands: gives up
    assert 0.04 <= time.monotonic() - started < 1.0
    landing = threading.Timer(0.05, stock.claimed, (claiming, [True, True], 7))
    landing.start()
    taken = stock.take_claimed(BLOCK, wait_s=5.0)
    landing.join()
    assert taken is not None and taken[0].alloc_id == 1 and taken[1] == 7


def test_puts_waiting_for_claims_on_their_way_each_take_one() -> None:
    """Two puts wait for the same oldest grant's claim; when the claims land one
    takes it and the other the next, neither gives up."""
    stock = GrantStock()
    stock.add(BLOCK, [grant(1), grant(2)])
    claiming = stock.to_claim()
    got: list[int] = []

    def put() -> None:
        taken = stock.take_claimed(BLOCK, wait_s=5.0)
        got.append(-1 if taken is None else taken[0].alloc_id)

    waiters = [threading.Thread(target=put) for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)  # (both waiting now, or about to find theirs landed)
    assert stock.claimed(claiming, [True, True], at_ns=3) == []
    for waiter in waiters:
        waiter.join(10)
    assert sorted(got) == [1, 2]


def test_claims_grown_old_are_claimed_again_without_deepening_the_stock() -> None:
    """``claims_older_than`` hands back the grants whose claim was sent before the
    cutoff, oldest first, as being claimed again: ``take_claimed`` cannot use them
    until the renewal lands (with its new clock), and waiting for a renewal is no
    sign of a thin stock."""
    stock = GrantStock()
    stock.add(BLOCK, [grant(1), grant(2), grant(3)])
    claiming = stock.to_claim()
    assert stock.claimed(claiming[:2], [True, True], at_ns=5) == []
    assert stock.claimed(claiming[2:], [True], at_ns=100) == []
    old = stock.claims_older_than(50)
    assert [g.alloc_id for g, _ in old] == [1, 2] and stock.claims_older_than(50) == []
    assert stock.take_claimed(BLOCK) is None and stock.target(BLOCK) == BASE_STOCK
    assert stock.claimed(old, [True, True], at_ns=200) == []
    taken = stock.take_claimed(BLOCK)
    assert taken is not None and taken[0].alloc_id == 1 and taken[1] == 200


def test_a_failed_renewal_hands_its_first_claim_back() -> None:
    """A renewal the node refused (a new master term aborted the claim) leaves the
    first claim held there: returned for release, the grant left unclaimed."""
    stock = GrantStock()
    stock.add(BLOCK, [grant(1), grant(2)])
    assert stock.claimed(stock.to_claim(), [True, True], at_ns=5) == []
    old = stock.claims_older_than(50)
    orphans = stock.claimed(old, [False, True], at_ns=60)
    assert [g.alloc_id for g, _ in orphans] == [1]
    assert stock.take_claimed(BLOCK) is None  # grant 1: no claim any more
    assert stock.take(BLOCK).alloc_id == 1 and stock.was_claimed(1) == 0  # type: ignore[union-attr]
    assert stock.was_claimed(2) == 60


def test_take_this_takes_only_the_grant_looked_at_while_oldest_and_fresh() -> None:
    stock = GrantStock()
    stock.add(BLOCK, [grant(1), grant(2)])
    first = stock.oldest(BLOCK)
    assert first is not None and first.alloc_id == 1 and len(stock) == 2  # looked, not taken
    assert stock.oldest(2 * BLOCK) is None  # another size
    assert stock.take_this(BLOCK, grant(1)) is None  # an equal grant is not the one looked at
    assert stock.take_this(BLOCK, first) == 0 and stock.used == 1 and len(stock) == 1  # no claim
    assert stock.take_this(BLOCK, first) is None  # taken once
    second = stock.oldest(BLOCK)
    assert second is not None and stock.take(BLOCK) is second  # another taker was first
    assert stock.take_this(BLOCK, second) is None and stock.used == 2
    stock.add(BLOCK, [grant(3, expires_in=-1)])
    old = stock.oldest(BLOCK)
    assert old is not None and stock.take_this(BLOCK, old) is None  # too old: ``take`` drops it


def test_take_this_hands_over_the_claim_taken_ahead_once() -> None:
    """A TCP put's grant claimed ahead (kvpool.cluster.client.claims): ``take_this``
    answers the claim's clock and forgets it, as ``was_claimed`` does, so the claim
    is the put's (released by it if its write fails), never the stock's to release."""
    stock = GrantStock()
    stock.add(BLOCK, [grant(1), grant(2)])
    assert stock.claimed(stock.to_claim(), [True, True], at_ns=7) == []
    first = stock.oldest(BLOCK)
    assert first is not None and stock.take_this(BLOCK, first) == 7
    assert stock.claims_of([1]) == [] and stock.claimed_in_stock() == 1
    assert stock.was_claimed(1) == 0


def test_grant_budget_from_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_PUT_GRANT_BYTES", "1048576")
    assert grant_budget() == 1 << 20 and grant_budget(0) == 0
    monkeypatch.setenv("KVPOOL_PUT_GRANT_BYTES", "lots")
    with pytest.raises(ValueError, match="KVPOOL_PUT_GRANT_BYTES"):
        grant_budget()
    with pytest.raises(ValueError, match=">= 0"):
        GrantStock(-1)


# -- a real cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["8MiB", "8MiB"])
    yield c
    c.stop()


@pytest.fixture
def pool(cluster: Cluster) -> Iterator[RemotePool]:
    with kvpool.connect(cluster.url, timeout=5) as p:
        assert wait_until(lambda: len(p.stats()["nodes"]) == 2, timeout=15)
        yield p
        for key in list(_stored):
            p.remove(key)
        _stored.clear()


_stored: list[bytes] = []


def put_all(pool: RemotePool, keys: list[bytes], first: int = 0) -> list[bool]:
    _stored.extend(keys)
    return [pool.put(k, payload(first + i)) for i, k in enumerate(keys)]


def check_bytes(pool: RemotePool, keys: list[bytes], first: int = 0) -> None:
    out = np.empty(BLOCK, np.uint8)
    for i, key in enumerate(keys):
        assert pool.get_into(key, out) == BLOCK and np.array_equal(out, payload(first + i))


def granted(pool: RemotePool) -> int:
    return int(pool.stats()["granted_bytes"])


def test_puts_after_the_first_ride_on_grants(pool: RemotePool) -> None:
    keys = make_keys(40, seed=11)
    assert put_all(pool, keys) == [True] * 40
    client = pool.stats()["client"]
    assert client["put_grants_used"] >= 30 and client["put_grant_refills"] >= 1
    depths = client["put_grant_depths"]  # deepened only if a refill came late here
    assert set(depths) <= {BLOCK} and all(BASE_STOCK < d <= MAX_STOCK for d in depths.values())
    assert 0 < granted(pool) <= 2 * DRAM // 16  # the master's cap on all grants
    assert pool.exists(keys) == [True] * 40 and pool.prefix_match(keys) == 40
    check_bytes(pool, keys)
    assert put_all(pool, keys[:3]) == [False] * 3  # already stored, through grants too


def test_claims_grown_old_in_the_stock_are_renewed_not_bypassed(pool: RemotePool) -> None:
    """Same host, real processes: after an idle spell past the claims' seal deadline
    (0.49 s) but inside the grants' window (1 s), the next puts renew the stock's
    claims and seal in shared memory in time. Before renewals every such put went
    the general way, its record late and its seal over TCP (~100 us against ~10)."""
    keys = make_keys(8, seed=21)
    assert put_all(pool, keys[:4]) == [True] * 4  # the first brings grants, claimed ahead
    time.sleep(0.55)
    before = pool.stats()["client"]
    assert put_all(pool, keys[4:], first=4) == [True] * 4
    after = pool.stats()["client"]
    assert after.get("seals_shm_late", 0) == before.get("seals_shm_late", 0)
    # all 4 in time (3 if a slow runner let the grants expire: a refill then)
    assert after["seals_shm"] - before["seals_shm"] >= 3
    check_bytes(pool, keys)


def test_grants_go_back_when_idle_and_on_close(cluster: Cluster, pool: RemotePool) -> None:
    put_all(pool, make_keys(5, seed=12))
    assert granted(pool) > 0
    assert wait_until(lambda: granted(pool) == 0, timeout=5)  # janitor revokes stale ones
    with kvpool.connect(cluster.url, timeout=5) as other:
        other.put(make_keys(1, seed=13)[0], payload(0))
        _stored.append(make_keys(1, seed=13)[0])
        assert granted(pool) > 0
    # close() revoked them (the revoke is sent, not waited for: the master may
    # answer this stats call on its other connection first)
    assert wait_until(lambda: granted(pool) == 0, timeout=2)


def test_a_grant_the_master_forgot_falls_back_to_a_classic_put(
    cluster: Cluster, pool: RemotePool
) -> None:
    keys = make_keys(3, seed=14)
    put_all(pool, keys[:1])
    stock = pool._putter.grants
    held = [g.alloc_id for q in stock._stock.values() for g in q]
    assert held
    with RpcClient(cluster.master.address) as admin:  # the grants expire behind its back
        admin.call(REVOKE, IdsRequest(held))
    used = pool.stats()["client"]["put_grants_used"]
    assert put_all(pool, keys[1:], first=1) == [True, True]
    assert pool.stats()["client"]["put_grants_used"] > used  # it tried a grant first
    check_bytes(pool, keys)


def test_zero_budget_turns_grants_off(cluster: Cluster) -> None:
    with kvpool.connect(cluster.url, timeout=5, put_grant_bytes=0) as p:
        keys = make_keys(5, seed=15)
        assert put_all(p, keys) == [True] * 5
        assert p.stats()["client"]["put_grants_used"] == 0 and granted(p) == 0
        for key in keys:
            p.remove(key)
        _stored.clear()


@pytest.mark.parametrize("share", ["0.25", "0"])
def test_the_masters_grant_share_caps_every_clients_grants(share: str) -> None:
    """``kvpool master --grant-share``: all grants together stay under that share of
    the DRAM (0.25 of 8 MiB: 32 of the 64 blocks a client stocks; the default 1/16
    would allow 8); 0 lends none, and puts ask the master for their space."""
    cluster = start_cluster(["8MiB"], "--grant-share", share)
    try:
        with kvpool.connect(cluster.url, timeout=5) as p:
            assert wait_until(lambda: len(p.stats()["nodes"]) == 1, timeout=15)
            keys = make_keys(40, seed=21)
            assert [p.put(k, payload(i)) for i, k in enumerate(keys)] == [True] * 40
            cap = int(float(share) * (8 << 20))
            lent = [granted(p)]  # grants unused for 1 s go back: keep putting while looking
            extra = iter(make_keys(40, seed=22))
            while cap and lent[-1] <= (8 << 20) // 16 and len(lent) < 40:
                assert p.put(next(extra), payload(0))
                lent.append(granted(p))
            assert (max(lent) > (8 << 20) // 16) == (cap > 0), lent
            assert max(lent) <= cap
            assert (p.stats()["client"]["put_grants_used"] > 0) == (cap > 0)
            check_bytes(p, keys)
    finally:
        cluster.stop()


def test_a_grant_share_outside_0_to_1_is_refused() -> None:
    for share in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="grant_share must be from 0 to 1"):
            MasterConfig(grant_share=share)


def test_a_changed_node_region_drops_its_grants(pool: RemotePool) -> None:
    put_all(pool, make_keys(2, seed=16))
    stock = pool._putter.grants
    node_id, region = next(iter(pool._session.regions.items()))
    mine = [g.alloc_id for q in stock._stock.values() for g in q if g.node_id == node_id]
    assert mine
    restarted = type(region).from_dict({**region.to_dict(), "shm_name": "kvpool-new-arena"})
    pool._session.learn({node_id: restarted})
    assert all(g.node_id != node_id for q in stock._stock.values() for g in q)
    dropped = stock.stale()
    assert set(mine) <= set(dropped)
    pool._putter.supply.revoke(dropped)  # what the janitor does with them
    pool._session.learn({node_id: region})


def test_an_unchanged_region_keeps_its_object(pool: RemotePool) -> None:
    """Every master reply names the regions again; an equal one keeps the object the
    session holds (the hot paths compare identities), and drops no grant."""
    put_all(pool, make_keys(2, seed=17))
    session, stock = pool._session, pool._putter.grants
    node_id, region = next(iter(session.regions.items()))
    before = len(stock)
    session.learn({node_id: type(region).from_dict(region.to_dict())})
    assert session.regions[node_id] is region and len(stock) == before


def test_bad_grant_requests_are_refused_and_change_nothing(
    cluster: Cluster, pool: RemotePool
) -> None:
    before = pool.stats()
    with RpcClient(cluster.master.address) as rpc:
        for bad in (
            AllocateRequest([], [], [], spare=-1, spare_size=BLOCK),
            AllocateRequest([], [], [], spare=2, spare_size=0),
        ):
            with pytest.raises(RemoteError, match="spare"):
                rpc.call(ALLOCATE, bad)
        reply = rpc.call(ALLOCATE, AllocateRequest([], [], [], spare=1, spare_size=BLOCK))
        alloc_id = reply["spares"][0][0]
        with pytest.raises(RemoteError, match="one per id"):
            rpc.call(COMMIT, CommitRequest([alloc_id], [None, None]))
        with pytest.raises(InvalidKeyError):
            rpc.call(COMMIT, CommitRequest([alloc_id], [b"short"]))
        assert rpc.call(COMMIT, CommitRequest([alloc_id])) == [False]  # a grant needs a key
        rpc.call(REVOKE, IdsRequest([alloc_id]))
    after = pool.stats()
    assert after["blocks"] == before["blocks"]
    assert after["granted_bytes"] == before["granted_bytes"]


def test_a_failed_grant_write_is_retried_the_classic_way(
    pool: RemotePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = make_keys(2, seed=17)
    put_all(pool, keys[:1])
    real = pool._session.transport
    failures = []

    class Flaky:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def write_many(self, plan: list) -> None:
            if not failures:
                failures.append(len(plan))
                raise ConnectionLostError("node restarted")
            self.inner.write_many(plan)  # type: ignore[attr-defined]

    monkeypatch.setattr(pool._session, "transport", lambda node_id: Flaky(real(node_id)))
    used = pool.stats()["client"]["put_grants_used"]
    assert put_all(pool, keys[1:], first=1) == [True]
    assert failures == [1] and pool.stats()["client"]["put_grants_used"] == used + 1
    monkeypatch.undo()
    check_bytes(pool, keys)


def test_a_failed_classic_write_is_retried_until_the_failover_deadline(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with kvpool.connect(cluster.url, timeout=5, put_grant_bytes=0, failover_s=1.0) as p:
        keys = make_keys(2, seed=18)
        real = p._session.transport
        calls: list[int] = []

        class Failing:
            def __init__(self, inner: object) -> None:
                self.inner = inner

            def write_many(self, plan: list) -> None:
                calls.append(len(plan))
                if len(calls) <= 1 or keys[1] in _stored:  # first try; then always
                    raise ConnectionLostError("node died")
                self.inner.write_many(plan)  # type: ignore[attr-defined]

        pending = p.stats()["pending_allocations"]
        monkeypatch.setattr(p._session, "transport", lambda node_id: Failing(real(node_id)))
        assert p.put(keys[0], payload(0)) is True and calls == [1, 1]
        _stored.append(keys[1])
        started = time.monotonic()
        with pytest.raises(PutFailedError) as failed:  # failing until the deadline
            p.put(keys[1], payload(1))
        assert failed.value.keys == [keys[1]] and len(calls) >= 4
        assert 1.0 - 0.3 <= time.monotonic() - started < 1.0 + 2.0  # failover_s, not longer
        monkeypatch.undo()
        assert p.exists(keys) == [True, False]
        assert p.stats()["pending_allocations"] == pending == 0  # the failed ones were revoked
        check_bytes(p, keys[:1])
        p.remove(keys[0])
        _stored.clear()


def test_claims_of_grants_dropped_while_claiming_are_handed_back() -> None:
    """A claim taken ahead for a grant that went stale (or whose node changed)
    while the claim was on its way must be released: held, it would keep every
    later allocation of that range waiting on the node. So must the claim of a
    grant a put took meanwhile: the put claimed it itself, and this late claim
    could land after the block was sealed, committed and freed."""
    stock = GrantStock(1 << 20)
    a, b, c = grant(1), grant(2), grant(3)
    stock.add(BLOCK, [a, b, c])
    claiming = stock.to_claim()
    assert [g.alloc_id for g, _ in claiming] == [1, 2, 3]
    assert stock.take(BLOCK) == a  # a put takes grant 1 while its claim is in flight
    stock.forget_node("n1")  # grants 2 and 3 are dropped (their node changed)
    orphans = stock.claimed(claiming, [True, True, False])
    assert [g.alloc_id for g, _ in orphans] == [1, 2]  # 3's claim failed: nothing held
    assert not stock.was_claimed(1)
