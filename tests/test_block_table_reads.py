"""The node's checked reads in its block table (kvpool.cluster.block_table):
a read in flight holds its block against newer claims and ``take_over``, and
``end_read`` wakes waiters only when some thread waits (the ``waiting`` count)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from kvpool.cluster.block_table import BlockTable
from kvpool.transport.fencing import FENCE_BUSY, FENCE_OK, WriteStamp

K1, K2 = b"\x01" * 16, b"\x02" * 16
SIZE = 4096


def written(wait: float = 5.0) -> BlockTable:
    """A table of term 3 holding block K1 at 0 and K2 at SIZE, both whole."""
    t = BlockTable(lambda offset, size: 1, claim_wait=wait)
    t.new_term(3)
    for alloc, (key, offset) in enumerate([(K1, 0), (K2, SIZE)], start=1):
        s = WriteStamp(3, alloc, offset, SIZE, key)
        assert t.claim(s, "w") == FENCE_OK
        assert t.finish(s, "w", ok=True, seal=True) == FENCE_OK
    return t


def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_a_newer_claim_waits_for_a_read_in_flight_and_takes_the_range_after_it() -> None:
    t = written()
    held = t.begin_read(K1, 0, 0, SIZE)
    assert held is not None and t.waiting == 0
    got: list[int] = []
    newer = WriteStamp(3, 9, 0, SIZE, K2)
    claimer = threading.Thread(target=lambda: got.append(t.claim(newer, "new")))
    claimer.start()
    until(lambda: t.waiting == 1)  # counted while it waits
    time.sleep(0.05)
    assert not got and t.state_of(0) is not None  # the block is still there, held
    t.end_read(held)  # the read ends: its notify wakes the claim at once
    claimer.join(2.0)
    assert got == [FENCE_OK] and t.waiting == 0
    assert t.begin_read(K1, 0, 0, SIZE) is None  # the range holds the new claim now


def test_a_claim_is_busy_after_its_bound_while_the_read_goes_on() -> None:
    t = written(wait=0.05)
    held = t.begin_read(K1, 0, 0, SIZE)
    assert t.claim(WriteStamp(3, 9, 0, SIZE, K2), "new") == FENCE_BUSY
    assert t.waiting == 0  # the timed-out waiter is no longer counted
    t.end_read(held)
    assert t.claim(WriteStamp(3, 9, 0, SIZE, K2), "new") == FENCE_OK


def test_take_over_waits_for_a_read_in_flight() -> None:
    t = written()
    held = t.begin_read(K2, SIZE, SIZE + 100, 1000)  # a part of the block
    assert held is not None
    done = threading.Event()
    taker = threading.Thread(target=lambda: (t.take_over(SIZE, SIZE), done.set()))
    taker.start()
    until(lambda: t.waiting == 1)
    assert not done.is_set()
    assert t.begin_read(K2, SIZE, SIZE, SIZE) is None  # aborted: no new read starts
    t.end_read(held)
    assert done.wait(2.0)
    assert t.state_of(SIZE) is None and t.waiting == 0
    assert t.state_of(0) is not None  # the other block is untouched


def test_reads_never_wait_and_notify_nobody_when_nobody_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``end_read`` with no waiter calls no ``notify_all`` (the cost of every read
    before); reads of other blocks go on while a claim waits for a held one."""
    t = written()
    notified: list[int] = []
    real = threading.Condition.notify_all

    def spy(self: threading.Condition) -> None:
        notified.append(1)
        real(self)

    monkeypatch.setattr(threading.Condition, "notify_all", spy)
    for _ in range(100):
        held = t.begin_read(K2, SIZE, SIZE, SIZE)
        assert held is not None
        t.end_read(held)
    assert notified == []
    held = t.begin_read(K1, 0, 0, SIZE)
    claimer = threading.Thread(target=t.claim, args=(WriteStamp(3, 9, 0, SIZE, K2), "new"))
    claimer.start()
    until(lambda: t.waiting == 1)
    start = time.monotonic()
    other = t.begin_read(K2, SIZE, SIZE, SIZE)  # another block: served at once
    assert other is not None and time.monotonic() - start < 0.5
    t.end_read(other)
    assert notified  # a claim waits: ending a read wakes it (it finds K1 still held)
    t.end_read(held)
    claimer.join(2.0)
    assert not claimer.is_alive() and t.waiting == 0


def test_reads_refuse_other_blocks_parts_outside_and_unfinished_claims() -> None:
    t = written()
    assert t.begin_read(K2, 0, 0, SIZE) is None  # another block holds the range
    assert t.begin_read(K1, SIZE, SIZE, SIZE) is None
    assert t.begin_read(K1, 0, 100, SIZE) is None  # past the block's end
    assert t.begin_read(K1, 100, 100, 10) is None  # not the block's offset
    pending = WriteStamp(3, 7, 2 * SIZE, SIZE, K1)
    assert t.claim(pending, "w") == FENCE_OK
    assert t.begin_read(K1, 2 * SIZE, 2 * SIZE, SIZE) is None  # bytes not whole yet
    held = [t.begin_read(K1, 0, 0, SIZE) for _ in range(3)]  # reads share a block
    assert all(h is not None for h in held)
    for h in held:
        t.end_read(h)
    assert t.claim(WriteStamp(3, 9, 0, SIZE, K2), "new") == FENCE_OK


def test_a_batch_of_reads_answers_each_read_in_order_and_holds_only_those_served() -> None:
    """``begin_reads`` (one lock for a pipelined batch) answers exactly as
    ``begin_read`` would, read by read; ``end_reads`` of the held ones frees them all."""
    t = written()
    assert t.claim(WriteStamp(3, 7, 2 * SIZE, SIZE, K1), "w") == FENCE_OK  # not whole yet
    reads = [
        (K1, 0, 0, SIZE),  # served
        (K2, 0, 0, SIZE),  # another block holds the range
        (K2, SIZE, SIZE + 100, 10),  # served: a part of the block
        (K1, 0, 100, SIZE),  # past the block's end
        (K1, 2 * SIZE, 2 * SIZE, SIZE),  # a claim: bytes not whole
        (K1, 5 * SIZE, 5 * SIZE, 1),  # nothing there
        (K1, 0, 0, SIZE),  # the same block again: held twice
    ]
    held = t.begin_reads(reads)
    assert [h is not None for h in held] == [True, False, True, False, False, False, True]
    assert held[0] is held[6]
    newer = WriteStamp(3, 9, 0, SIZE, K2)
    t.claim_wait = 0.05
    assert t.claim(newer, "new") == FENCE_BUSY  # K1 is held by two reads
    t.end_reads([h for h in held if h is not None])
    assert t.claim(newer, "new") == FENCE_OK and t.waiting == 0
    assert t.begin_reads([]) == []


def test_a_block_freed_while_read_serves_no_new_read_is_not_listed_and_goes_after() -> None:
    """A heartbeat free that finds a read in flight (its lease ran out mid-read) was
    dropped: the block stayed in the table and the next registration's listing
    brought the removed key back to the master."""
    t = written()
    assert t.committed(K1, 0, SIZE, None, 1) is not None and t.state_of(0) == "committed"
    held = t.begin_read(K1, 0, 0, SIZE)
    assert held is not None
    t.freed(0, 1)
    assert t.begin_read(K1, 0, 0, SIZE) is None  # freed: no new read starts
    assert [entry[0] for entry in t.listing()] == [K2]  # never reported to a master again
    assert t.state_of(0) is not None  # the read in flight still has its bytes
    t.end_read(held)
    assert t.state_of(0) is None and t.state_of(SIZE) is not None
    assert t.claim(WriteStamp(3, 9, 0, SIZE, K2), "new") == FENCE_OK  # the range is free
