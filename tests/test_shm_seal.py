"""Seals in shared memory (kvpool.transport.shm_seal): a same-host put acknowledged
without the node's SEAL round trip, bounded by a deadline on the host's clock.

Unit tests drive the node's real BlockTable and the real seal file with an
injected clock (the deadline logic), and the client's bracket
(kvpool.cluster.client.fenced) against a real TCP data server; the proof with
real processes (a master killed -9 right after puts acknowledged through
this path) is at the end.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from clusterhelpers import start_cluster, wait_until
from poolhelpers import BLOCK, make_keys, payload
from sealhelpers import K1, K2, P1, PAGE, ahead, real, table
from transport_fakes import OneSided

import kvpool
from kvpool.cluster.block_table import CLAIMED, COMMITTED, WRITTEN, BlockTable
from kvpool.cluster.client import fenced
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import FENCE_BUSY, FENCE_OK, FENCE_STALE, WriteStamp
from kvpool.transport.shm_seal import Deadline, SealRecords
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

MS = 1_000_000


class Clock:
    """An injected CLOCK_MONOTONIC (ns) that moves only when told to."""

    def __init__(self, now: int = 10**12) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def records(
    tmp_path: Any, hold_ms: int = 100, margin_ms: int = 10
) -> tuple[SealRecords, SealRecords]:
    """(the node's file, a writer's mapping of it)."""
    path = str(tmp_path / "arena.seal")
    node = SealRecords(path, 16 * PAGE, create=True, hold_ns=hold_ms * MS, margin_ns=margin_ms * MS)
    return node, SealRecords(path, 16 * PAGE, create=False)


# -- the record and the deadline --------------------------------------------------------


def test_a_record_is_read_back_as_written_and_cleared_by_the_node(tmp_path) -> None:
    node, writer = records(tmp_path, hold_ms=500, margin_ms=10)
    assert writer.deadline == Deadline(500 * MS, 10 * MS)  # the writer reads the node's numbers
    assert node.read(PAGE) is None
    assert writer.write(real(7, PAGE))
    assert node.read(PAGE) == (real(7, PAGE), False)
    assert writer.write(WriteStamp(3, 8, 2 * PAGE, PAGE, K2))  # no parent
    assert node.read(2 * PAGE) == (WriteStamp(3, 8, 2 * PAGE, PAGE, K2, None), False)
    node.clear(PAGE)
    assert node.read(PAGE) is None
    assert not writer.write(real(9, 5))  # not a block start
    assert not writer.write(real(9, 16 * PAGE))  # past the arena
    writer.close()
    node.close()
    assert not (tmp_path / "arena.seal").exists()


def test_the_deadline_leaves_the_margin_on_both_sides() -> None:
    d = Deadline(hold_ns=100, margin_ns=10)
    assert d.writer_in_time(1000, 1089) and not d.writer_in_time(1000, 1090)
    assert not d.node_may_abort(1000, 1109) and d.node_may_abort(1000, 1110)


# -- the node's table ---------------------------------------------------------------------


def test_a_claim_taken_ahead_is_cleared_then_its_record_adopted(tmp_path) -> None:
    node, writer = records(tmp_path)
    t = table(node, Clock())
    writer.write(real(5))  # a record left from an earlier allocation of the range
    owner = object()
    assert t.claim(ahead(6), owner) == FENCE_OK
    assert t.used_bytes() == (0, 0)  # cleared before the claim was granted: nothing adopted
    writer.write(real(6))
    assert t.used_bytes() == (PAGE, 1) and t.state_of(0) == WRITTEN
    assert t.listing() and t.listing()[0][0] == K1  # the record's key, not the placeholder
    t.owner_gone(owner)  # the claim's hold ended with the adoption
    assert t.state_of(0) == COMMITTED


def test_a_record_of_another_allocation_is_ignored(tmp_path) -> None:
    node, writer = records(tmp_path)
    t = table(node, Clock())
    assert t.claim(ahead(6), object()) == FENCE_OK
    writer.write(real(5))  # older allocation id
    writer.write(real(6, epoch=2))  # older term
    assert t.used_bytes() == (0, 0) and t.state_of(0) == CLAIMED


def test_a_commit_event_adopts_the_record_and_a_later_free_drops_it(tmp_path) -> None:
    node, writer = records(tmp_path)
    t = table(node, Clock())
    assert t.claim(ahead(6), object()) == FENCE_OK  # the hold stays: the writer sends no SEAL
    writer.write(real(6))
    assert t.committed(K1, 0, PAGE, P1, 6) is not None
    assert t.state_of(0) == COMMITTED
    t.freed(0, 6)  # no write in flight any more: the free drops it
    assert t.state_of(0) is None


def test_a_new_term_lists_a_sealed_claim_and_aborts_one_past_its_deadline(tmp_path) -> None:
    node, writer = records(tmp_path, hold_ms=100, margin_ms=10)
    clock = Clock()
    t = table(node, clock)
    owner = object()
    assert t.claim(ahead(6, 0), owner) == FENCE_OK
    assert t.claim(ahead(7, PAGE), owner) == FENCE_OK
    writer.write(real(6, 0))
    clock.now += 110 * MS  # past deadline + margin: the node need not wait
    started = time.monotonic()
    t.suspend()
    assert time.monotonic() - started < 0.05
    assert [row[1] for row in t.listing()] == [0]  # the sealed one is kept
    writer.write(real(7, PAGE))  # too late: the claim was aborted, never adopted
    assert t.used_bytes() == (PAGE, 1)
    assert t.finish(real(7, PAGE), owner, ok=True, seal=True) == FENCE_STALE  # TCP seal refused


def test_a_new_term_waits_for_a_claim_inside_its_deadline(tmp_path) -> None:
    """Real clock: the node may not abort the claim before its deadline, and a
    record written while it waits is adopted and listed (the node looks again
    at the deadline: nothing wakes it earlier)."""
    node, writer = records(tmp_path, hold_ms=300, margin_ms=10)
    t = table(node)
    assert t.claim(ahead(6), object()) == FENCE_OK
    late = threading.Timer(0.1, writer.write, (real(6),))
    late.start()
    t.suspend()
    late.join()
    assert [row[0] for row in t.listing()] == [K1]


def test_a_new_term_waits_no_longer_than_the_deadline(tmp_path) -> None:
    node, _ = records(tmp_path, hold_ms=150, margin_ms=10)
    t = table(node)
    assert t.claim(ahead(6), object()) == FENCE_OK
    started = time.monotonic()
    t.suspend()
    waited = time.monotonic() - started
    assert 0.14 <= waited < 1.0
    assert t.listing() == [] and t.state_of(0) == CLAIMED  # aborted, held by its writer
    assert t.claim(ahead(6), object()) == FENCE_STALE


def test_a_claim_taken_ahead_again_restarts_its_deadline(tmp_path) -> None:
    """Its writer renews a claim that grew old in its stock (kvpool.cluster.client.
    claims): a new term waits for the renewed deadline, not the first one. Real
    clock; the bound is from the renewal, so a slow runner only shortens the wait."""
    node, _ = records(tmp_path, hold_ms=150, margin_ms=10)
    t = table(node)
    assert t.claim(ahead(6), object()) == FENCE_OK
    time.sleep(0.1)  # the first deadline (+ margin) is 60 ms away now
    renewed_at = time.monotonic()
    assert t.claim(ahead(6), object()) == FENCE_OK
    t.suspend()
    assert time.monotonic() - renewed_at >= 0.15
    assert t.state_of(0) == CLAIMED and t.listing() == []  # aborted at the renewed deadline


def test_a_renewed_claim_is_held_once(tmp_path) -> None:
    """A renewal sent on another pooled connection adds no write in flight: one
    release ends the claim, and the range's next allocation is granted at once
    (a second hold would have kept it BUSY until the connection closed)."""
    node, _ = records(tmp_path)
    t = table(node, Clock())
    first, other = object(), object()
    assert t.claim(ahead(6), first) == FENCE_OK
    assert t.claim(ahead(6), other) == FENCE_OK  # the renewal
    assert t.finish(ahead(6), other, ok=False, seal=False, any_owner=True) == FENCE_OK
    started = time.monotonic()
    assert t.claim(ahead(7), object()) == FENCE_OK  # a newer allocation of the range
    assert time.monotonic() - started < 0.1  # (claim_wait is 0.2 s)


def test_a_claim_not_taken_ahead_is_held_again(tmp_path) -> None:
    """A put's own claim (its real key) of a grant claimed ahead is a second write
    in flight, as before renewals: releasing the claim taken ahead leaves it held."""
    node, _ = records(tmp_path)
    t = table(node, Clock())
    assert t.claim(ahead(6), "background") == FENCE_OK
    assert t.claim(real(6), "put") == FENCE_OK
    assert t.finish(ahead(6), "background", ok=False, seal=False) == FENCE_OK
    assert t.claim(ahead(7), object()) == FENCE_BUSY  # the put still holds it


def test_claims_not_taken_ahead_are_not_waited_for(tmp_path) -> None:
    node, _ = records(tmp_path, hold_ms=5000)
    t = table(node)
    assert t.claim(real(6), object()) == FENCE_OK  # a put's own claim: sealed over TCP
    started = time.monotonic()
    t.suspend()
    assert time.monotonic() - started < 0.5


# -- the writer's bracket ----------------------------------------------------------------


@pytest.fixture
def node(tmp_path) -> Iterator[tuple[np.ndarray, BlockTable, SealRecords, TcpTransport, OneSided]]:
    region = np.zeros(16 * PAGE, np.uint8)
    seals, writer = records(tmp_path, hold_ms=200, margin_ms=10)
    fence = table(seals)
    server = TcpDataServer(region, fence=fence)
    server.start()
    info = RegionInfo("n", region.nbytes, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance = server.instance
    control = TcpTransport(info, timeout=5)
    yield region, fence, writer, control, OneSided(info, region)
    control.close()
    server.close()
    writer.close()
    seals.close()


def claim_ahead(control: TcpTransport, stamps: list[WriteStamp]) -> int:
    at = time.monotonic_ns()  # read before the claims leave, as kvpool.cluster.client.claims does
    assert fenced.ops(control, w.OP_CLAIM, stamps) == [w.ST_OK] * len(stamps)
    return at


def test_in_time_the_put_is_done_without_a_seal_round_trip(node) -> None:
    region, fence, writer, control, data = node
    at = claim_ahead(control, [ahead(6, 0), ahead(7, PAGE)])
    items = [
        (real(6, 0), 0, np.full(PAGE, 1, np.uint8)),
        (real(7, PAGE, key=K2), PAGE, np.full(PAGE, 2, np.uint8)),
    ]
    counts: Counter[str] = Counter()
    claims, sealing = fenced.write_blocks_begin(
        data, control, items, {0: at, 1: at}, writer, counts
    )
    assert claims == [w.ST_OK, w.ST_OK] and sealing is None  # nothing left in flight
    assert counts["seals_shm"] == 2
    fence.suspend()  # a master restart right after the ack: both are listed
    assert sorted(row[0] for row in fence.listing()) == [K1, K2]
    assert (region[:PAGE] == 1).all() and (region[PAGE : 2 * PAGE] == 2).all()


def test_a_claim_past_its_deadline_is_never_acknowledged_on_its_record(node) -> None:
    """Injected writer clock past the deadline: the record is written but the
    put falls back to the TCP seal, whose answer decides."""
    _, fence, writer, control, data = node
    at = claim_ahead(control, [ahead(6, 0)])
    counts: Counter[str] = Counter()
    late = lambda: at + 200 * MS  # noqa: E731  (hold 200 ms: past hold - margin)
    items = [(real(6, 0), 0, np.full(PAGE, 1, np.uint8))]
    claims, sealing = fenced.write_blocks_begin(data, control, items, {0: at}, writer, counts, late)
    assert claims == [w.ST_OK] and sealing is not None and counts["seals_shm_late"] == 1
    assert sealing() == [w.ST_OK]  # the node still held the claim: its SEAL says yes
    assert fence.state_of(0) == WRITTEN


def test_a_late_record_after_the_node_aborted_is_refused(node) -> None:
    _, fence, writer, control, data = node
    at = claim_ahead(control, [ahead(6, 0)])
    fence.suspend()  # waits out the 200 ms hold: the claim is aborted, nothing sealed
    items = [(real(6, 0), 0, np.full(PAGE, 1, np.uint8))]
    claims, sealing = fenced.write_blocks_begin(data, control, items, {0: at}, writer, Counter())
    assert claims == [w.ST_OK] and sealing is not None  # the real clock is past the deadline too
    assert sealing() == [w.ST_STALE]
    assert fence.listing() == []


def test_stale_epoch_claims_are_still_refused(node) -> None:
    _, _, _, control, _ = node
    assert fenced.ops(control, w.OP_CLAIM, [ahead(6, 0, epoch=2)]) == [w.ST_STALE]


# -- the proof, with real processes --------------------------------------------------------


@pytest.mark.parametrize(("shm_seal", "node_commits"), [("1", "1"), ("1", "0"), ("0", "1")])
def test_a_master_kill_right_after_shm_sealed_acks_loses_none(
    shm_seal: str, node_commits: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts acknowledged on their shared-memory seal (no SEAL round trip), the
    master killed -9 at once and restarted: every acknowledged put is found by
    another client with exact bytes. ``KVPOOL_NODE_COMMITS``: their commits left
    to the node (1, kvpool.cluster.node_commits) or sent by the writer (0).
    ``KVPOOL_SHM_SEAL=0``: every seal sent to the node (the fallback path)."""
    monkeypatch.setenv("KVPOOL_SHM_SEAL", shm_seal)
    monkeypatch.setenv("KVPOOL_NODE_COMMITS", node_commits)
    cluster = start_cluster(["16MiB", "16MiB"])
    try:
        keys = make_keys(48, seed=41)
        with kvpool.connect(cluster.url, timeout=5) as writer:
            assert wait_until(lambda: len(writer.stats()["nodes"]) == 2, timeout=15)
            for i, key in enumerate(keys):
                assert writer.put(key, payload(i))
            cluster.master.kill()
            cluster.master = cluster.restart_master_process()
            writer.flush()
            sealed = writer.stats()["client"].get("seals_shm", 0)
            by_node = writer._putter.commits.by_node.count
            if shm_seal == "1":  # the path under test
                assert sealed >= len(keys) // 2, writer.stats()["client"]
                assert by_node >= len(keys) // 2 if node_commits == "1" else by_node == 0
            else:
                assert sealed == 0 and by_node == 0
            with kvpool.connect(cluster.url, timeout=5) as reader:
                assert wait_until(lambda: reader.exists(keys) == [True] * len(keys), timeout=15)
                out = np.empty(BLOCK, np.uint8)
                for i in range(len(keys)):
                    assert reader.get_into(keys[i], out) == BLOCK
                    assert np.array_equal(out, payload(i))
    finally:
        cluster.stop()
