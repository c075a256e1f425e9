"""Spinning before a TCP receive (kvpool.transport.spin_wait, issue 17).

The native wait: it returns True as soon as the socket is readable (data, EOF),
False once its budget passed, never reads a byte, releases the GIL while it
spins, and lets at most ``max_spinners`` threads spin at once. The module: its
environment settings, their refusals, the off switch. End to end: a real
cluster read and written over TCP with spinning on and off, byte-exact, the
spins counted in ``stats()``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
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

import kvpool
from kvpool.transport import spin_wait

if not spin_wait.active() and os.environ.get("KVPOOL_REQUIRE_SPIN_WAIT") == "1":
    pytest.fail(f"KVPOOL_REQUIRE_SPIN_WAIT=1 but spinning is {spin_wait.STATUS}", pytrace=False)
try:
    native = importlib.import_module("kvpool.transport._spin_wait")
except ImportError as exc:
    native, WHY = None, f"kvpool.transport._spin_wait not built: {exc}"
else:
    WHY = ""
needs_native = pytest.mark.skipif(native is None, reason=WHY)
MS = 1_000_000  # ns


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


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


def _module_in(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        """
        from kvpool.transport import spin_wait
        print(spin_wait.STATUS)
        print(spin_wait.active(), spin_wait.counters())
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
    assert status == "up to 250 us before each blocking receive, 3 thread(s) at a time"
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
            assert stats["ready"] > 0
            assert stats["waits"] == stats["ready"] + stats["timeouts"] + stats["crowded"]
        with kvpool.connect(cluster.url, transport="tcp") as pool:  # this process too
            for i, (key, size) in enumerate(zip(keys, SIZES, strict=True)):
                out = np.zeros(size, np.uint8)
                assert pool.get_into(key, out) == size
                assert np.array_equal(out, payload(i + 11, size))
    finally:
        cluster.stop()
