"""How the TCP client receives (kvpool.transport.tcp_recv, issue 17).

The native wait: it returns True as soon as the socket is readable (data, EOF),
False once its budget passed, never reads a byte, releases the GIL while it
spins, and lets at most ``max_spinners`` threads spin at once. The native fill
(``recv_all``): every buffer filled exactly from a stream that arrives in
pieces, more buffers than one receive takes, nothing read past the last one,
EOF, the socket's timeout, signals and bad arguments (the native batch of
checked reads: ``test_tcp_read_blocks.py``). The module: its environment
settings, their refusals, the off switch. End to end: a real cluster read and
written over TCP with spinning on and off, byte-exact, the spins counted in
``stats()``.
"""

from __future__ import annotations

import ast
import hashlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from clusterhelpers import start_cluster, wait_until
from poolhelpers import make_keys, payload
from tcprecvhelpers import native, needs_native, pause_rule, send_in_pieces

import kvpool
from kvpool.errors import ConnectionLostError
from kvpool.rpc.frame import set_io_timeout
from kvpool.transport import tcp_recv, tcp_wire

if not tcp_recv.active() and os.environ.get("KVPOOL_REQUIRE_TCP_RECV") == "1":
    pytest.fail(f"KVPOOL_REQUIRE_TCP_RECV=1 but spinning is {tcp_recv.STATUS}", pytrace=False)
MS = 1_000_000  # ns


@pytest.fixture(autouse=True)
def no_spin_pause() -> Iterator[None]:
    """These tests time whole budgets: no pause after a long yield (another
    process's turn on this CPU) may cut one short (test_tcp_spin_pause.py)."""
    with pause_rule(10**9, 10, 1000):
        yield


def _timed(fd: int, budget_ns: int) -> tuple[bool, float]:
    assert native is not None
    started = time.monotonic()
    ready = native.wait_readable(fd, budget_ns)
    return ready, time.monotonic() - started


@needs_native
def test_nothing_to_read_spins_the_budget_then_says_so(pair) -> None:
    ready, took = _timed(pair[0].fileno(), 20 * MS)
    assert not ready
    assert 0.02 <= took < 1.0


@needs_native
def test_bytes_already_there_return_at_once_and_stay_unread(pair) -> None:
    a, b = pair
    b.sendall(b"reply")
    ready, took = _timed(a.fileno(), 5000 * MS)
    assert ready and took < 1.0
    assert a.recv(16) == b"reply"  # poll only looked


@needs_native
def test_bytes_that_arrive_during_the_spin_end_it(pair) -> None:
    a, b = pair
    threading.Timer(0.05, b.sendall, args=(b"late",)).start()
    ready, took = _timed(a.fileno(), 5000 * MS)
    assert ready and 0.04 <= took < 2.0
    assert a.recv(16) == b"late"


@needs_native
def test_a_closed_peer_is_ready_too(pair) -> None:
    a, b = pair
    b.close()
    ready, took = _timed(a.fileno(), 5000 * MS)
    assert ready and took < 1.0
    assert a.recv(16) == b""  # EOF: the receive does not sleep either


@needs_native
def test_a_wait_for_more_than_a_byte_ends_when_that_many_are_queued(pair) -> None:
    """``want``: the spin ends once that many bytes are queued (not at the first),
    runs out its budget while fewer are, and ends at once at the peer's EOF."""
    a, b = pair
    b.sendall(b"x" * 1000)
    started = time.monotonic()
    assert not native.wait_readable(a.fileno(), 50 * MS, 4096)  # 1000 < 4096 queued
    assert time.monotonic() - started >= 0.04
    b.sendall(b"y" * 3096)
    started = time.monotonic()
    assert native.wait_readable(a.fileno(), 5000 * MS, 4096)
    assert time.monotonic() - started < 1.0
    b.shutdown(socket.SHUT_WR)
    assert native.wait_readable(a.fileno(), 5000 * MS, 1 << 20)  # EOF: no more will come
    assert a.recv(8192) == b"x" * 1000 + b"y" * 3096  # poll and SIOCINQ only looked
    # how much a receive of a large reply waits for: what the budget brings at 2.5 GB/s
    budgets = (0, 40_000, 100_000, MS)
    assert [native.want_for_budget(ns) for ns in budgets] == [0, 100_000, 250_000, 256 << 10]


@needs_native
def test_a_replys_first_receive_waits_for_64_kib_at_most(pair) -> None:
    """``wait_readable`` serves a reply's first receive: wanting a whole 1 MiB reply,
    it ends once 64 KiB are queued (nothing is copied until it returns), and with
    less than that queued it runs out its budget."""
    assert native.FIRST_WANT_MAX == 64 << 10  # (tcp_recv.STATUS reports it)
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # a quarter: well over 64 KiB
    b.sendall(b"x" * ((64 << 10) - 1))
    assert not native.wait_readable(a.fileno(), 50 * MS, 1 << 20)
    b.sendall(b"y")
    started = time.monotonic()
    assert native.wait_readable(a.fileno(), 5000 * MS, 1 << 20)
    assert time.monotonic() - started < 1.0


@needs_native
def test_no_budget_means_no_spin_and_bad_arguments_are_refused(pair) -> None:
    before = native.counters()["waits"]
    assert native.wait_readable(pair[0].fileno(), 0) is False
    assert native.wait_readable(pair[0].fileno(), -5) is False
    assert native.counters()["waits"] == before  # nothing was attempted
    with pytest.raises(ValueError, match="fd must be >= 0"):
        native.wait_readable(-1, MS)
    with pytest.raises(TypeError):
        native.wait_readable("3", MS)
    with pytest.raises(ValueError, match="between 0 and"):
        native.set_max_spinners(-1)


def test_a_writes_answer_waits_longer_by_its_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    """``spin_ack``: the plain budget plus 1 ns per 2 payload bytes, capped; nothing
    at all while spinning is off."""
    budgets: list[int] = []
    monkeypatch.setattr(tcp_recv, "_wait", lambda fd, budget: budgets.append(budget))
    plain = tcp_recv.SPIN_US * 1000 if tcp_recv.SPINNERS else 0
    for sent in (0, 64 << 10, 1 << 20, 1 << 40):
        tcp_recv.spin_ack(3, sent)
    cap = tcp_recv.ACK_EXTRA_MAX_US * 1000
    assert budgets == [plain, plain + (32 << 10), plain + (1 << 19), plain + cap]
    monkeypatch.setattr(tcp_recv, "_wait", None)
    tcp_recv.spin_ack(3, 1 << 20)  # off: returns at once, nothing called
    assert len(budgets) == 4


@needs_native
def test_a_writes_answer_that_does_not_come_is_spun_for_the_longer_budget(pair) -> None:
    if not tcp_recv.active():
        pytest.skip(f"spinning is {tcp_recv.STATUS}")
    started = time.monotonic()
    tcp_recv.spin_ack(pair[0].fileno(), 1 << 20)  # nothing comes: the whole budget
    took = time.monotonic() - started
    assert tcp_recv.SPIN_US * 1e-6 + (1 << 19) * 1e-9 <= took < 1.0


@needs_native
def test_past_max_spinners_a_caller_blocks_at_once(pair) -> None:
    a = pair[0]
    c, d = socket.socketpair()
    limit = native.counters()["max_spinners"]
    native.set_max_spinners(1)
    try:
        first = threading.Thread(target=native.wait_readable, args=(c.fileno(), 400 * MS))
        first.start()
        time.sleep(0.05)  # the first thread is spinning now
        crowded = native.counters()["crowded"]
        ready, took = _timed(a.fileno(), 5000 * MS)
        assert not ready and took < 0.2
        assert native.counters()["crowded"] == crowded + 1
        first.join()
        ready, _ = _timed(a.fileno(), 10 * MS)  # the slot is free again: a real spin
        assert native.counters()["crowded"] == crowded + 1
    finally:
        native.set_max_spinners(limit)
        c.close()
        d.close()


@needs_native
def test_the_gil_is_released_while_spinning(pair) -> None:
    done = threading.Event()
    steps = 0

    def count() -> None:
        nonlocal steps
        while not done.is_set():
            steps += 1

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.01)
    try:
        before = steps
        native.wait_readable(pair[0].fileno(), 200 * MS)
        progressed = steps - before
    finally:
        done.set()
        counter.join()
    # Holding the GIL for 200 ms would leave the counter where it was (it can only
    # run in the switch interval's slices before the call).
    assert progressed > 1000


@needs_native
@pytest.mark.parametrize("budget_ns", [0, 100_000])
def test_recv_all_fills_every_buffer_exactly_and_reads_no_further(pair, budget_ns: int) -> None:
    a, b = pair
    lengths = [16, 48, 0, 65536, 1, 300_000, 7]
    stream = np.random.default_rng(5).integers(0, 256, sum(lengths) + 9, dtype=np.uint8)
    outs = [bytearray(n) for n in lengths]
    sender = threading.Thread(target=send_in_pieces, args=(b, stream.tobytes(), 13, 0.002))
    sender.start()
    got = native.recv_all(a.fileno(), [memoryview(o) for o in outs], 0, budget_ns)
    sender.join()
    assert got == sum(lengths)
    assert b"".join(outs) == stream[: sum(lengths)].tobytes()
    assert a.recv(64) == stream[sum(lengths) :].tobytes()  # the next reply's bytes stay put


def _spins(before: dict[str, int]) -> dict[str, int]:
    """How the native spins ended since ``before`` (``native.counters()``)."""
    after = native.counters()
    return {k: after[k] - before[k] for k in ("waits", "ready", "timeouts", "crowded")}


@needs_native
def test_the_rest_of_a_large_reply_is_received_a_quarter_mib_at_a_time(pair) -> None:
    """A reply that trickles in (64 sends of 16 KiB) is received exactly; each receive
    (without MSG_WAITALL) waits, spinning, until a quarter MiB is queued (at most a
    quarter of the socket's receive buffer), so it takes at most total / that many
    receives, not one per send: in the loop's receives that shows whenever no spin
    ran out first (then the receive takes what is there)."""
    a, b = pair
    data = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    out = bytearray(len(data))
    want = min(256 << 10, a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4)
    before = native.counters()
    sender = threading.Thread(target=send_in_pieces, args=(b, data, 64, 0.0002))
    sender.start()
    got = native.recv_all(a.fileno(), [memoryview(out)], 0, 1000 * MS)
    sender.join()
    assert got == len(data) and out == data
    spins = _spins(before)
    if spins["ready"] == spins["waits"]:
        assert spins["waits"] <= -(-len(data) // want)


@needs_native
def test_a_reply_that_stalls_past_the_budget_is_received_whole(pair) -> None:
    """The rest of a reply stops coming for longer than the spin budget: that spin
    runs out and the receive blocks for what comes next, as without spinning."""
    a, b = pair
    data = bytes(range(256)) * 1200  # 300 KiB
    out = bytearray(len(data))
    before = native.counters()

    def stall() -> None:
        b.sendall(data[:100_000])
        time.sleep(0.2)
        b.sendall(data[100_000:])

    threading.Thread(target=stall).start()
    assert native.recv_all(a.fileno(), [memoryview(out)], 0, 20 * MS) == len(data)
    assert out == data
    spins = _spins(before)  # the stalled receive's spin ran out (unless another thread spun)
    assert spins["timeouts"] + spins["crowded"] >= 1


@needs_native
def test_eof_in_the_middle_of_a_reply_ends_the_spin_at_once(pair) -> None:
    """The peer's EOF (POLLRDHUP) ends a spin waiting for a quarter MiB at once, not
    when its (here 5 s) budget runs out."""
    a, b = pair
    b.sendall(b"x" * 1000)
    b.shutdown(socket.SHUT_WR)
    started = time.monotonic()
    out = bytearray(1 << 20)
    assert native.recv_all(a.fileno(), [memoryview(out)], 0, 5000 * MS) == 1000
    assert time.monotonic() - started < 2.0


@needs_native
def test_recv_all_with_waitall_and_into_numpy_views(pair) -> None:
    a, b = pair
    data = np.arange(100_000, dtype=np.uint32).astype(np.uint8)
    head, body = bytearray(64), np.zeros(data.nbytes - 64, np.uint8)
    threading.Thread(target=send_in_pieces, args=(b, data.tobytes(), 4, 0.001)).start()
    views = [memoryview(head), memoryview(body)]
    assert native.recv_all(a.fileno(), views, socket.MSG_WAITALL, 0) == data.nbytes
    assert bytes(head) + body.tobytes() == data.tobytes()


@needs_native
def test_recv_all_returns_short_at_eof_and_recv_scatter_raises(pair) -> None:
    a, b = pair
    b.sendall(b"x" * 100)
    b.close()
    out = bytearray(1000)
    assert native.recv_all(a.fileno(), [memoryview(out)], 0, 100_000) == 100
    c, d = socket.socketpair()
    try:
        d.sendall(b"y" * 10)
        d.close()
        with pytest.raises(ConnectionLostError, match="10 of 1000 B"):
            tcp_wire.recv_scatter(c, [memoryview(bytearray(1000))], 1000)
    finally:
        c.close()


@needs_native
def test_recv_all_raises_blocking_io_at_the_sockets_timeout(pair) -> None:
    a = pair[0]
    set_io_timeout(a, 0.2)  # SO_RCVTIMEO: the data path's inactivity timeout
    started = time.monotonic()
    with pytest.raises(BlockingIOError):
        native.recv_all(a.fileno(), [memoryview(bytearray(10))], 0, 100_000)
    assert 0.15 <= time.monotonic() - started < 5.0


class _Alarm(Exception):
    pass


@needs_native
def test_recv_all_runs_signal_handlers_and_stops_only_if_one_raises(pair) -> None:
    a, b = pair
    calls = []
    previous = signal.signal(signal.SIGALRM, lambda *_: calls.append(1))
    try:  # a handler that returns: the receive goes on and completes
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        threading.Timer(0.2, b.sendall, args=(b"z" * 8,)).start()
        out = bytearray(8)
        assert native.recv_all(a.fileno(), [memoryview(out)], 0, 0) == 8
        assert calls == [1] and out == b"z" * 8

        def alarm(*_: object) -> None:
            raise _Alarm

        signal.signal(signal.SIGALRM, alarm)  # a handler that raises: so does recv_all
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(_Alarm):
            native.recv_all(a.fileno(), [memoryview(bytearray(8))], 0, 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@needs_native
def test_recv_all_fills_more_buffers_than_one_receive_takes(pair) -> None:
    """Past IOV_MAX (1024) buffers: several receives of at most 1024 each, in order."""
    a, b = pair
    data = bytes(range(256)) * 10
    outs = [bytearray(1) for _ in range(len(data) - 10)] + [bytearray(10)]
    b.sendall(data + b"next")
    assert native.recv_all(a.fileno(), [memoryview(o) for o in outs], 0, 0) == len(data)
    assert b"".join(outs) == data
    assert a.recv(16) == b"next"


@needs_native
def test_recv_all_refuses_bad_arguments(pair) -> None:
    fd = pair[0].fileno()
    with pytest.raises(TypeError):
        native.recv_all(fd, (memoryview(bytearray(4)),), 0, 0)  # a tuple, not a list
    with pytest.raises(BufferError):
        native.recv_all(fd, [memoryview(b"read-only")], 0, 0)
    with pytest.raises(ValueError, match="fd must be >= 0"):
        native.recv_all(-1, [memoryview(bytearray(1))], 0, 0)
    with pytest.raises(BufferError, match="not C-contiguous"):
        native.recv_all(fd, [memoryview(bytearray(8))[::2]], 0, 0)
    assert native.recv_all(fd, [], 0, 0) == 0  # nothing to fill: no receive


def _module_in(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        """
        from kvpool.transport import tcp_recv
        print(tcp_recv.STATUS)
        print(tcp_recv.active(), tcp_recv.counters())
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("name", ["KVPOOL_TCP_SPIN_US", "KVPOOL_TCP_SPINNERS"])
def test_zero_turns_spinning_off(name: str) -> None:
    out = _module_in({name: "0"})
    assert out.returncode == 0, out.stderr
    status, state = out.stdout.splitlines()
    assert status.startswith("off ($KVPOOL_TCP_SPIN_US or $KVPOOL_TCP_SPINNERS is 0)")
    assert state == "False {}"


@needs_native
def test_the_settings_reach_the_native_wait() -> None:
    out = _module_in({"KVPOOL_TCP_SPIN_US": "250", "KVPOOL_TCP_SPINNERS": "3"})
    assert out.returncode == 0, out.stderr
    status, state = out.stdout.splitlines()
    assert status == (
        "up to 250 us before each blocking receive (a write's acknowledgement: up to 1000 us"
        " more, by its payload; a large reply: 64 KiB queued before its first receive, then"
        " 256 KiB at a time), 3 thread(s) at a time, paused 10-1000 ms after a yield of 500 us"
    )
    assert state.startswith("True {'waits': 0") and "'max_spinners': 3" in state


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVPOOL_TCP_SPIN_US", "abc"),
        ("KVPOOL_TCP_SPIN_US", "-5"),
        ("KVPOOL_TCP_SPIN_US", "2000000"),
        ("KVPOOL_TCP_SPINNERS", "1.5"),
    ],
)
def test_a_bad_setting_is_refused_with_its_name(name: str, value: str) -> None:
    out = _module_in({name: value})
    assert out.returncode != 0
    assert f"${name} must be an integer from 0 to" in out.stderr and repr(value) in out.stderr


SIZES = [64 << 10, 1 << 20, (3 << 20) + 100]
CLIENT = """
import hashlib, sys
import numpy as np
import kvpool
from poolhelpers import payload
url, sizes, keys = sys.argv[1], sys.argv[2], sys.argv[3]
with kvpool.connect(url, transport="tcp") as pool:
    for i, (size, key) in enumerate(zip(map(int, sizes.split(",")), keys.split(","))):
        assert pool.put(bytes.fromhex(key), payload(i + 11, size))
    pool.flush()
    for size, key in zip(map(int, sizes.split(",")), keys.split(",")):
        out = np.zeros(size, np.uint8)
        assert pool.get_into(bytes.fromhex(key), out) == size
        print(hashlib.sha256(out).hexdigest())
    print(pool.stats()["transports"]["tcp"]["spin"])
"""


@pytest.mark.parametrize("spin_us", ["100", "0"])
def test_tcp_puts_and_reads_are_exact_with_spinning_on_and_off(spin_us: str) -> None:
    cluster = start_cluster(["64MiB"])
    try:
        with kvpool.connect(cluster.url) as probe:
            assert wait_until(lambda: len(probe.stats()["nodes"]) == 1, timeout=15)
        keys = make_keys(len(SIZES), seed=57 + int(spin_us))
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "KVPOOL_TCP_SPIN_US": spin_us, "PYTHONPATH": tests_dir}
        args = [",".join(map(str, SIZES)), ",".join(k.hex() for k in keys)]
        run = subprocess.run(
            [sys.executable, "-c", CLIENT, cluster.url, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        *digests, spin = run.stdout.splitlines()
        expected = [hashlib.sha256(payload(i + 11, s)).hexdigest() for i, s in enumerate(SIZES)]
        assert digests == expected
        if spin_us == "0":
            assert spin.startswith("{'status': 'off ($KVPOOL_TCP_SPIN_US")
        elif native is not None:
            stats = ast.literal_eval(spin)  # the dict the client printed
            assert stats["status"].startswith("up to 100 us")
            assert stats["waits"] >= 2 * len(SIZES)  # an ack per put, a reply per read
            # every wait ends one way; which depends on timing (a reply may take longer
            # than 100 us under load, so none need land in the spin: a CI run once saw
            # ready == 0; another process's turn on the CPU pauses spinning): what a spin
            # finds is pinned down by the socket-pair tests and test_tcp_spin_pause.py
            ends = ("ready", "timeouts", "crowded", "long_yields", "paused")
            assert stats["waits"] == sum(stats[k] for k in ends)
        with kvpool.connect(cluster.url, transport="tcp") as pool:  # this process too
            for i, (key, size) in enumerate(zip(keys, SIZES, strict=True)):
                out = np.zeros(size, np.uint8)
                assert pool.get_into(key, out) == size
                assert np.array_equal(out, payload(i + 11, size))
    finally:
        cluster.stop()


def test_a_tcp_put_waits_for_its_answer_by_its_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A put's write over TCP (the straight path's and the batch's) receives its
    answer through ``spin_ack`` with what it sent; a read's reply does not."""
    from kvpool.transport import tcp_conn

    seen: list[int] = []
    real = tcp_conn.spin_ack
    monkeypatch.setattr(tcp_conn, "spin_ack", lambda fd, sent: (seen.append(sent), real(fd, sent)))
    cluster = start_cluster(["64MiB"])
    try:
        with kvpool.connect(cluster.url, transport="tcp") as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
            a, b, c = make_keys(3, seed=61)
            assert pool.put(a, payload(1, 1 << 20))
            assert max(seen) >= 1 << 20
            seen.clear()
            assert pool.put_batch([b, c], [payload(2, 1 << 20), payload(3, 1 << 20)]) == [True] * 2
            assert max(seen) >= 2 << 20  # the batch's answers: both payloads before them
            seen.clear()
            out = np.zeros(1 << 20, np.uint8)
            assert pool.get_into(c, out) == 1 << 20 and np.array_equal(out, payload(3, 1 << 20))
            assert max(seen, default=0) < 1 << 20  # a read waits with the plain budget
    finally:
        cluster.stop()
