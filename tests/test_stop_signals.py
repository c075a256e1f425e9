"""StopSignals: a stop signal sets a flag only; the main thread acts on it.

The process-level test is the one that proves it: a real ``kvpool master`` and
``kvpool node`` end, with status 0, within a stated deadline after SIGTERM,
also when signals come again and again (each used to nest one more handler
blocked on the event's lock: issue 17's session found such a master hung).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from kvpool.procs import spawn_kvpool
from kvpool.stop_signals import POLL_S, StopSignals

EXIT_DEADLINE_S = 10.0


@pytest.fixture
def stops():
    s = StopSignals()
    yield s
    s.restore()


def test_a_signal_stops_the_wait_and_sets_the_event(stops: StopSignals) -> None:
    assert not stops.stopping
    signal.raise_signal(signal.SIGTERM)  # the handler runs now, in this (main) thread
    assert stops.received == signal.SIGTERM
    assert not stops.event.is_set()  # the handler only stored the number
    started = time.monotonic()
    assert stops.wait(timeout=5.0)
    assert time.monotonic() - started < 1.0
    assert stops.event.is_set()


def test_the_first_signal_is_kept(stops: StopSignals) -> None:
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGTERM)
    assert stops.received == signal.SIGINT
    assert stops.wait(timeout=1.0)


def test_another_thread_may_stop_the_wait(stops: StopSignals) -> None:
    threading.Timer(0.1, stops.event.set).start()
    assert stops.wait(timeout=5.0)
    assert stops.received is None


def test_wait_times_out_without_a_signal(stops: StopSignals) -> None:
    started = time.monotonic()
    assert not stops.wait(timeout=3 * POLL_S)
    assert 3 * POLL_S <= time.monotonic() - started < 1.0
    assert not stops.event.is_set()


def test_a_signal_while_the_event_lock_is_held_does_not_deadlock(stops: StopSignals) -> None:
    """The old handler called ``event.set()``: run while this thread held the
    event's lock (as ``Event.wait`` does on entry and on each timeout), it waited
    for that lock forever. The new handler runs fine in the same spot."""
    with stops.event._cond:  # the state Event.wait leaves the main thread in
        signal.raise_signal(signal.SIGTERM)
    assert stops.wait(timeout=1.0)


def test_once_stopping_later_stop_signals_are_ignored(stops: StopSignals) -> None:
    signal.raise_signal(signal.SIGTERM)
    assert stops.wait(timeout=1.0)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    signal.raise_signal(signal.SIGTERM)  # ignored: this process goes on


def test_restore_puts_back_the_previous_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    s = StopSignals()
    assert signal.getsignal(signal.SIGTERM) != before
    s.restore()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("repeats", [1, 20])
def test_master_and_node_exit_promptly_on_sigterm(repeats: int) -> None:
    master = spawn_kvpool(["master", "--host", "127.0.0.1", "--port", "0"])
    node = None
    try:
        node = spawn_kvpool(["node", "--master", master.address, "--dram", str(8 << 20)])
        for child in (node, master):
            for _ in range(repeats):
                child.popen.send_signal(signal.SIGTERM)
                time.sleep(0.001)
            assert child.popen.wait(timeout=EXIT_DEADLINE_S) == 0
    finally:
        for child in (node, master):
            if child is not None:
                child.stop()
