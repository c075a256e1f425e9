"""Control-plane RPC against a real server process: handshake, pipelining, timeouts."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvpool.errors import (
    CallTimeoutError,
    ConnectionLostError,
    FrameTooLargeError,
    HandshakeRefusedError,
    InsecureBindError,
    PoolFullError,
    ProtocolError,
    RemoteError,
)
from kvpool.rpc import RpcClient, RpcServer, ServerConfig, WireMessage, encode_frame, read_frame
from kvpool.rpc.frame import HEADER, MAGIC, decode_body
from kvpool.rpc.messages import Hello, Request, decode_envelope, encode_envelope

SERVER = r"""
import sys, threading, time
from kvpool.errors import PoolFullError
from kvpool.rpc import RpcServer, ServerConfig
token, port = sys.argv[1] or None, int(sys.argv[2])
s = RpcServer(ServerConfig(host="127.0.0.1", port=port, token=token, max_frame=1 << 20, workers=8))
never = threading.Event()
s.register("echo", lambda p: p, inline=True)
s.register("sleep", lambda p: (time.sleep(p), p)[1])
s.register("never", lambda p: never.wait(60))
def full(p):
    raise PoolFullError("no room")
s.register("full", full)
s.register("crash", lambda p: 1 / 0)
s.register("unencodable", lambda p: object())
print(s.start()[1], flush=True)
sys.stdin.read()
never.set()
s.close()
"""


def _spawn(token: str = "", port: int = 0) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, token, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, port


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    proc, port = _spawn()
    yield port
    _stop(proc)


@pytest.fixture(scope="module")
def secured() -> Iterator[int]:
    proc, port = _spawn("s3cret")
    yield port
    _stop(proc)


@dataclass
class Alloc(WireMessage):
    key: bytes
    size: int
    tiers: list[str] = field(default_factory=list)
    hint: float | None = None


def test_message_roundtrip_and_validation() -> None:
    msg = Alloc(b"k" * 16, 4096, ["dram"], 0.5)
    assert Alloc.from_dict(msg.to_dict()) == msg
    assert Alloc.from_dict({"key": b"x", "size": 1, "extra": 1}) == Alloc(b"x", 1)
    with pytest.raises(ProtocolError, match="missing field 'size'"):
        Alloc.from_dict({"key": b"x"})
    with pytest.raises(ProtocolError, match="expected int"):
        Alloc.from_dict({"key": b"x", "size": True})
    env = Request(7, "alloc", msg.to_dict())
    body = decode_body(encode_frame(encode_envelope(env))[HEADER.size :])
    assert decode_envelope(body) == env


def test_frame_limits() -> None:
    with pytest.raises(FrameTooLargeError):
        encode_frame({"x": b"a" * 100}, max_frame=50)
    with pytest.raises(ProtocolError):
        decode_body(b"\xc1")
    with pytest.raises(ProtocolError, match="must be a map"):
        decode_body(b"\x01")


def test_call_and_errors(server: int) -> None:
    with RpcClient(("127.0.0.1", server), timeout=5) as c:
        assert c.call("echo", {"a": [1, b"\x00"]}) == {"a": [1, b"\x00"]}
        assert c.call("echo", Alloc(b"k", 3)) == {"key": b"k", "size": 3, "tiers": [], "hint": None}
        with pytest.raises(PoolFullError, match="no room"):
            c.call("full")
        with pytest.raises(RemoteError) as exc:
            c.call("crash")
        assert exc.value.code == "internal" and exc.value.remote_type == "ZeroDivisionError"
        with pytest.raises(RemoteError, match="no_such_method"):
            c.call("nope")
        with pytest.raises(RemoteError, match="unencodable"):
            c.call("unencodable")
        assert c.call("echo", 5) == 5  # the connection survived every failure


def test_pipelining_out_of_order(server: int) -> None:
    with RpcClient(("127.0.0.1", server), timeout=5) as c:
        slow = c.submit("sleep", 0.4)
        fast = [c.submit("sleep", 0.0) for _ in range(5)]
        t0 = time.monotonic()
        assert [c.wait(f) for f in fast] == [0.0] * 5
        assert time.monotonic() - t0 < 0.3 and not slow.done()
        assert c.wait(slow) == 0.4
        assert c.call_many([("echo", i) for i in range(200)]) == list(range(200))


def test_many_threads_one_client(server: int) -> None:
    with RpcClient(("127.0.0.1", server), timeout=5) as c:
        out: dict[int, list[int]] = {}

        def worker(t: int) -> None:
            out[t] = [c.call("echo", t * 1000 + i) for i in range(50)]

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(out[t] == [t * 1000 + i for i in range(50)] for t in range(4))


def test_call_timeout_then_connection_still_usable(server: int) -> None:
    with RpcClient(("127.0.0.1", server), timeout=5) as c:
        t0 = time.monotonic()
        with pytest.raises(CallTimeoutError):
            c.call("never", timeout=0.3)
        assert time.monotonic() - t0 < 1.0
        assert c.call("echo", 1) == 1


def test_silent_server_handshake_times_out() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionLostError, match="timed out"):
            RpcClient(listener.getsockname(), connect_timeout=0.3)
        assert time.monotonic() - t0 < 2
    finally:
        listener.close()


def test_dead_server_fails_pending_and_new_calls() -> None:
    proc, port = _spawn()
    c = RpcClient(("127.0.0.1", port), timeout=5)
    pending = c.submit("never")
    proc.kill()
    proc.wait()
    with pytest.raises(ConnectionLostError):
        c.wait(pending)
    t0 = time.monotonic()
    with pytest.raises(ConnectionLostError, match="cannot connect"):
        c.call("echo", 1)
    assert time.monotonic() - t0 < 2
    with pytest.raises(ConnectionError):  # the built-in base class works too
        RpcClient(("127.0.0.1", port))


def test_token(secured: int) -> None:
    with RpcClient(("127.0.0.1", secured), token="s3cret") as c:
        assert c.call("echo", "ok") == "ok"
    with pytest.raises(HandshakeRefusedError, match="wrong token"):
        RpcClient(("127.0.0.1", secured), token="guess")
    with pytest.raises(HandshakeRefusedError, match="missing token"):
        RpcClient(("127.0.0.1", secured), token="")


def test_version_mismatch_refused(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=5) as s:
        s.sendall(encode_frame(encode_envelope(Hello(version=999))))
        reply = decode_envelope(read_frame(s, idle_ok=False) or {})
        assert not reply.ok and "999" in reply.reason  # type: ignore[union-attr]
        assert s.recv(1) == b""


def test_insecure_bind_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    with pytest.raises(InsecureBindError):
        RpcServer(ServerConfig(host="0.0.0.0"))
    monkeypatch.setenv("KVPOOL_TOKEN", "t")
    srv = RpcServer(ServerConfig(host="0.0.0.0"))
    assert srv.token == "t"
    srv.close()


def test_bad_frames_answered_and_closed(server: int) -> None:
    cases = {
        b"XX\x01\x00\x00\x00\x00\x01\x80": "bad_frame",
        HEADER.pack(MAGIC, 1, 0, 1 << 30): "frame_too_large",
        HEADER.pack(MAGIC, 1, 0, 1) + b"\x07": "bad_frame",
    }
    for raw, code in cases.items():
        with socket.create_connection(("127.0.0.1", server), timeout=5) as s:
            s.sendall(encode_frame(encode_envelope(Hello(version=1))))
            assert decode_envelope(read_frame(s, idle_ok=False) or {}).ok  # type: ignore[union-attr]
            s.sendall(raw)
            err = read_frame(s, idle_ok=False)
            assert err is not None and err["t"] == "err" and err["code"] == code
            assert s.recv(1) == b""
    with RpcClient(("127.0.0.1", server)) as c:
        assert c.call("echo", "still up") == "still up"


def test_stalled_half_frame_is_dropped() -> None:
    srv = RpcServer(ServerConfig(io_timeout=0.3, handshake_timeout=0.3))
    srv.register("echo", lambda p: p)
    host, port = srv.start()
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(encode_frame(encode_envelope(Hello(version=1)))[:5])  # half a header
            t0 = time.monotonic()
            assert s.recv(1) == b""  # the server gave up on us
            assert time.monotonic() - t0 < 3
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(encode_frame(encode_envelope(Hello(version=1))))
            assert read_frame(s, idle_ok=False) is not None
            s.sendall(encode_frame(encode_envelope(Request(1, "echo", 1)))[:-1])  # stalls
            assert s.recv(1) == b""
        with RpcClient((host, port)) as c:  # an idle connection is never dropped
            time.sleep(0.6)
            assert c.call("echo", 3) == 3
    finally:
        srv.close()


def test_a_client_that_stops_reading_is_dropped_after_io_timeout() -> None:
    """A send that makes no progress for ``io_timeout`` (the kernel's send timeout on
    an established connection) drops that client; the server keeps serving others."""
    srv = RpcServer(ServerConfig(io_timeout=0.3, handshake_timeout=0.3))
    srv.register("blob", lambda n: b"x" * n)
    host, port = srv.start()
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
            s.sendall(encode_frame(encode_envelope(Hello(version=1))))
            assert read_frame(s, idle_ok=False) is not None
            for i in range(64):  # 64 MiB of replies this client never reads
                s.sendall(encode_frame(encode_envelope(Request(i + 1, "blob", 1 << 20))))
            time.sleep(1.0)  # > io_timeout with the server's send stuck: it drops us
            deadline = time.monotonic() + 5
            with pytest.raises(OSError):  # its socket is gone: a send meets a reset
                while time.monotonic() < deadline:
                    s.sendall(encode_frame(encode_envelope(Request(999, "blob", 1))))
                    time.sleep(0.05)
        with RpcClient((host, port)) as c:
            assert c.call("blob", 3) == b"xxx"
    finally:
        srv.close()


def test_reconnects_after_server_restart() -> None:
    proc, port = _spawn()
    c = RpcClient(("127.0.0.1", port), timeout=5)
    assert c.call("echo", 1) == 1
    proc.kill()
    proc.wait()
    with pytest.raises(ConnectionLostError):
        c.call("echo", 2)
    proc, _ = _spawn(port=port)  # e.g. a restarted master on its fixed port
    try:
        assert c.call("echo", 3) == 3  # the next call reconnects (and re-handshakes)
    finally:
        c.close()
        _stop(proc)
