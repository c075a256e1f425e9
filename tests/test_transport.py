"""Data path against a node process: TCP (zero-copy recv_into) and same-host shm."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvpool.errors import (
    BufferSpecError,
    ConnectionLostError,
    HandshakeRefusedError,
    TransportUnavailableError,
)
from kvpool.transport.base import RegionInfo, host_identity
from kvpool.transport.peers import PeerTransports
from kvpool.transport.select import candidates, select_transport
from kvpool.transport.shm import ShmTransport
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

REGION = 40 << 20
SIZES = [1, 7, 4096, 65_537, (1 << 20) + 3, 16 << 20]

NODE = r"""
import mmap, os, sys
import numpy as np
from kvpool.transport.base import host_identity
from kvpool.transport.tcp_server import TcpDataServer
name, size, token = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, size)
region = np.frombuffer(mmap.mmap(fd, size), np.uint8)
region[:] = np.resize(np.arange(251, dtype=np.uint8), size)
srv = TcpDataServer(region, host="127.0.0.1", port=0, token=token)
print(srv.start()[1], host_identity(), srv.instance, flush=True)
try:
    sys.stdin.read()
finally:
    srv.close()
    os.unlink("/dev/shm/" + name)
"""


def _pattern(offset: int, n: int) -> np.ndarray:
    return np.resize(np.roll(np.arange(251, dtype=np.uint8), -(offset % 251)), n)


def _spawn(token: str = "") -> tuple[subprocess.Popen[str], RegionInfo]:
    name = f"kvpool-test-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE, name, str(REGION), token],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    port, host_id, instance = proc.stdout.readline().split()
    info = RegionInfo("n1", REGION, host_id, "127.0.0.1", int(port), name, tcp_instance=instance)
    return proc, info


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def node() -> Iterator[RegionInfo]:
    proc, info = _spawn()
    yield info
    _stop(proc)


def _outputs(n: int) -> list[object]:
    return [np.empty(n, np.uint8), torch.empty(n, dtype=torch.uint8), bytearray(n)]


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_exact_bytes(node: RegionInfo, kind: str) -> None:
    t = TcpTransport(node) if kind == "tcp" else ShmTransport(node)
    rng = np.random.default_rng(1)
    with t:
        for i, n in enumerate(SIZES):
            off = 3 * i + 1
            for out in _outputs(n):
                t.read_into(off, out)
                assert np.array_equal(
                    np.frombuffer(memoryview(out).cast("B"), np.uint8)
                    if not isinstance(out, torch.Tensor)
                    else out.numpy(),
                    _pattern(off, n),
                )
            data = rng.integers(0, 256, n, dtype=np.uint8)
            for src in (data, torch.from_numpy(data), bytearray(data.tobytes())):
                woff = (20 << 20) + i
                t.write(woff, src)
                back = np.empty(n, np.uint8)
                t.read_into(woff, back)
                assert np.array_equal(back, data)
        t.write(0, _pattern(0, 1 << 20))  # restore what other tests read


def test_tcp_batch_and_cross_transport(node: RegionInfo) -> None:
    with TcpTransport(node) as tcp, ShmTransport(node) as shm:
        items = [(i * 100_003, np.full(50_000 + i, i, np.uint8)) for i in range(10)]
        tcp.write_many(items)
        outs = [(off, np.empty_like(buf)) for off, buf in items]
        tcp.read_many(outs)
        for (_, want), (off, got) in zip(items, outs, strict=True):
            assert np.array_equal(got, want)
            viashm = np.empty_like(got)
            shm.read_into(off, viashm)
            assert np.array_equal(viashm, want)
        shm.write(0, _pattern(0, 1 << 20))


def test_ranges_refused(node: RegionInfo) -> None:
    with TcpTransport(node) as tcp, ShmTransport(node) as shm:
        for t in (tcp, shm):
            with pytest.raises(BufferSpecError, match="outside the region"):
                t.read_into(REGION - 3, np.empty(4, np.uint8))
            with pytest.raises(BufferSpecError):
                t.write(-1, b"x")
            with pytest.raises(BufferSpecError, match="read-only"):
                t.read_into(0, b"immutable")
        out = np.empty(8, np.uint8)
        tcp.read_into(5, out)
        assert np.array_equal(out, _pattern(5, 8))


def test_a_restarted_data_server_refuses_clients_of_its_predecessor(node: RegionInfo) -> None:
    stale = RegionInfo(**{**node.to_dict(), "tcp_instance": "0123456789abcdef"})
    with TcpTransport(stale) as t, pytest.raises(HandshakeRefusedError, match="incarnation"):
        t.read_into(0, np.empty(8, np.uint8))
    with TcpTransport(node) as t:  # the right instance, or none at all, is served
        t.read_into(0, np.empty(8, np.uint8))
    with TcpTransport(RegionInfo(**{**node.to_dict(), "tcp_instance": ""})) as t:
        t.read_into(0, np.empty(8, np.uint8))


def test_an_older_data_client_is_told_its_version_at_once(node: RegionInfo) -> None:
    import struct

    from kvpool.transport import tcp_wire as w

    with socket.create_connection(("127.0.0.1", node.tcp_port), timeout=5) as s:
        s.sendall(struct.pack("!4sHH", w.MAGIC, 1, 0))  # version 1: no instance field
        magic, status, n = w.HELLO_REPLY.unpack(s.recv(w.HELLO_REPLY.size))
        assert (magic, status) == (w.MAGIC, w.ST_BAD_VERSION)
        assert b"data protocol 1 unsupported" in s.recv(n)


def test_server_refuses_out_of_range_from_raw_client(node: RegionInfo) -> None:
    from kvpool.transport import tcp_wire as w

    with socket.create_connection(("127.0.0.1", node.tcp_port), timeout=5) as s:
        s.sendall(w.hello(None))
        assert w.HELLO_REPLY.unpack(s.recv(w.HELLO_REPLY.size))[1] == w.ST_OK
        s.sendall(w.REQ.pack(w.OP_READ, 0, 9, REGION - 1, 2))
        status, rid, n = w.RESP.unpack(s.recv(w.RESP.size))
        assert (status, rid) == (w.ST_RANGE, 9) and b"outside" in s.recv(n)
        s.sendall(w.REQ.pack(w.OP_READ, 0, 10, 0, 3))  # still usable after a bad read
        status, rid, n = w.RESP.unpack(s.recv(w.RESP.size))
        assert (status, rid, n) == (w.ST_OK, 10, 3)


def test_token_and_dead_node() -> None:
    proc, info = _spawn("tok")
    try:
        with pytest.raises(HandshakeRefusedError, match="wrong token"):
            TcpTransport(info, token="bad").read_into(0, bytearray(1))
        t = TcpTransport(info, token="tok", timeout=2)
        out = bytearray(3)
        t.read_into(0, out)
        assert bytes(out) == _pattern(0, 3).tobytes()
    finally:
        proc.kill()
        proc.wait()
        os.unlink(f"/dev/shm/{info.shm_name}")
    t0 = time.monotonic()
    with pytest.raises(ConnectionLostError):
        t.read_into(0, bytearray(1 << 20))
    assert time.monotonic() - t0 < 3


def test_insecure_data_bind_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.errors import InsecureBindError

    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    with pytest.raises(InsecureBindError):
        TcpDataServer(bytearray(16), host="0.0.0.0")


def test_select_transport(node: RegionInfo) -> None:
    with select_transport(node, override=None) as t:
        assert t.name == "shm"
    with select_transport(node, override="tcp") as t:
        assert t.name == "tcp"
    remote = RegionInfo("n2", REGION, "other-host", "127.0.0.1", node.tcp_port, node.shm_name)
    with select_transport(remote, override="") as t:
        assert t.name == "tcp"
    with pytest.raises(TransportUnavailableError, match="shm: node is not on this host"):
        select_transport(remote, override="shm")
    assert candidates(remote) == ["shm", "tcp"]
    assert host_identity() == node.host_id


def test_select_respects_env(node: RegionInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_TRANSPORT", "tcp")
    with select_transport(node) as t:
        assert t.name == "tcp"
    monkeypatch.setenv("KVPOOL_TRANSPORT", "ucx")
    try:
        import ucxx  # noqa: F401
    except ImportError:
        with pytest.raises(TransportUnavailableError, match="ucxx is not installed"):
            select_transport(node)


@pytest.mark.parametrize("bad", ["bogus", "tcp,auto", ",", " , "])
def test_a_preference_naming_no_real_transport_is_refused_up_front(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client refuses it when it is made (before any put allocates), from the
    argument or from ``$KVPOOL_TRANSPORT``, naming the choices."""
    monkeypatch.delenv("KVPOOL_TRANSPORT", raising=False)
    with pytest.raises(TransportUnavailableError, match=r"choose from shm, ucx, tcp"):
        PeerTransports(override=bad)
    monkeypatch.setenv("KVPOOL_TRANSPORT", bad)
    with pytest.raises(TransportUnavailableError, match=r"\$KVPOOL_TRANSPORT="):
        PeerTransports()
    for fine in ("TCP", "ucx, tcp", ""):  # any case, spaces; empty: automatic
        PeerTransports(override=fine).close()


def test_byte_counters(node: RegionInfo) -> None:
    with TcpTransport(node) as tcp, ShmTransport(node) as shm:
        for t in (tcp, shm):
            t.read_into(0, np.empty(10, np.uint8))
            t.read_many([(0, bytearray(5)), (5, bytearray(5))])
            assert (t.bytes_read, t.bytes_written) == (20, 0)


def test_region_info_roundtrip() -> None:
    from kvpool.transport.base import UcxInfo

    info = RegionInfo("n", 10, "h", "127.0.0.1", 5, "arena", UcxInfo("h", 1, b"\x00addr", True))
    assert RegionInfo.from_dict(info.to_dict()) == info
    assert RegionInfo.from_dict(RegionInfo("n", 1).to_dict()).ucx is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_buffers(node: RegionInfo) -> None:
    with TcpTransport(node) as tcp, ShmTransport(node) as shm:
        for t in (tcp, shm):
            out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            t.read_into(3, out)
            assert np.array_equal(out.cpu().numpy(), _pattern(3, 1 << 20))
            src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
            t.write(30 << 20, src)
            back = np.empty(1 << 20, np.uint8)
            t.read_into(30 << 20, back)
            assert np.array_equal(back, src.cpu().numpy())


def test_data_server_survives_garbage() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvpool.transport import tcp_wire as w

    proc, info = _spawn()
    hello = w.hello(None)
    reqs = st.builds(
        w.REQ.pack,
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(0, 2**32 - 1),
        st.sampled_from([0, 1, REGION - 1, REGION, 2**63]),
        st.sampled_from([0, 1, 100, REGION, 2**63]),
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(handshake=st.booleans(), junk=st.lists(reqs | st.binary(max_size=40), max_size=4))
    def poke(handshake: bool, junk: list[bytes]) -> None:
        with socket.create_connection(("127.0.0.1", info.tcp_port), timeout=10) as s:
            try:
                s.sendall((hello if handshake else b"") + b"".join(junk))
                s.shutdown(socket.SHUT_WR)
                while s.recv(1 << 20):  # the server must finish and close, never hang
                    pass
            except TimeoutError:
                raise
            except OSError:  # reset / not connected: the server already closed on us
                pass

    try:
        poke()
        with TcpTransport(info) as t:
            out = np.empty(4096, np.uint8)
            t.read_into(REGION - 4096, out)
            assert out.nbytes == 4096  # still serving (contents may have been overwritten)
    finally:
        _stop(proc)


def test_tcp_concurrent_threads_share_a_pool(node: RegionInfo) -> None:
    import threading

    from kvpool.errors import PoolClosedError

    t = TcpTransport(node, max_connections=2)
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for i in range(20):
                off = (k * 7919 + i * 104_729) % (1 << 20)
                out = np.empty(65_536 + i, np.uint8)
                t.read_into(off, out)
                assert np.array_equal(out, _pattern(off, out.nbytes))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and t._open <= 2
    t.close()
    with pytest.raises(PoolClosedError):
        t.read_into(0, bytearray(1))
