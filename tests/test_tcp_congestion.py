"""The data path's TCP congestion control: chosen before each connection exists.

Against the real kernel over loopback: a client socket from ``connect`` and the
connection a ``listen`` socket accepts both run the chosen algorithm, whatever
the host's default; ``ss`` (iproute2) confirms it for the node's data server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from kvpool.errors import TransportUnavailableError
from kvpool.transport import tcp_congestion as cc
from kvpool.transport.tcp_conn import DataConn
from kvpool.transport.tcp_server import TcpDataServer

OPTION = getattr(socket, "TCP_CONGESTION", None)
needs_option = pytest.mark.skipif(
    OPTION is None or not cc.offered(), reason="no TCP_CONGESTION / algorithm list (not Linux)"
)


def _algorithm(sock: socket.socket) -> str:
    assert OPTION is not None
    return sock.getsockopt(socket.IPPROTO_TCP, OPTION, 16).rstrip(b"\0").decode()


def _not_the_default() -> str:
    """An algorithm the kernel offers that is not the host's default (reno is built in)."""
    default = cc.host_default()
    return next(a for a in ["cubic", "reno", *cc.offered()] if a != default and a in cc.offered())


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> str:
    """The module's choice set to an algorithm other than the host's default, so a
    socket that runs it got it from us."""
    name = _not_the_default()
    monkeypatch.setattr(cc, "CHOSEN", cc.Congestion(name, explicit=True))
    return name


def test_the_variable_names_an_algorithm_or_the_hosts_default() -> None:
    assert cc.parse(None) == cc.parse("") == cc.parse("  ") == cc.DEFAULT == "cubic"
    assert cc.parse("system") is None
    assert cc.parse(" bbr ") == "bbr"
    for bad in ["BBR", "cubic;rm", "a" * 16, "two words"]:
        with pytest.raises(ValueError, match=r"\$KVPOOL_TCP_CONGESTION"):
            cc.parse(bad)


@needs_option
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_connection_and_the_one_it_reaches_run_the_chosen_algorithm(
    chosen: str, host: str
) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        listener = cc.listen(host, 0)
    except OSError as exc:  # IPv6 built in but no loopback address for it
        pytest.skip(f"cannot listen on {host}: {exc}")
    with listener, cc.connect(listener.getsockname()[:2], timeout=5) as client:
        accepted, _ = listener.accept()
        with accepted:
            assert _algorithm(client) == chosen  # set before connect
            assert _algorithm(accepted) == chosen  # taken from the listener
            client.sendall(b"x")
            assert accepted.recv(1) == b"x"


@needs_option
def test_the_hosts_default_is_left_alone_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cc, "CHOSEN", cc.Congestion(None, explicit=False))
    listener = cc.listen("127.0.0.1", 0)
    with listener, cc.connect(listener.getsockname(), timeout=5) as client:
        assert _algorithm(client) == cc.host_default()
    assert cc.CHOSEN.status() == {"data_path": "host default", "host_default": cc.host_default()}


@needs_option
def test_an_algorithm_the_kernel_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Named explicitly: the first data connection fails, naming the variable and the
    kernel's choices (nothing is left open). The default: best effort, said in status."""
    listener = cc.listen("127.0.0.1", 0)
    with listener:
        monkeypatch.setattr(cc, "CHOSEN", cc.Congestion("nosuchcc", explicit=True))
        with pytest.raises(
            TransportUnavailableError, match=r"KVPOOL_TCP_CONGESTION=nosuchcc.*it offers"
        ):
            cc.connect(listener.getsockname(), timeout=5)
        with pytest.raises(TransportUnavailableError, match="nosuchcc"):
            DataConn("127.0.0.1", listener.getsockname()[1], None, 5)
        quiet = cc.Congestion("nosuchcc", explicit=False)
        monkeypatch.setattr(cc, "CHOSEN", quiet)
        with cc.connect(listener.getsockname(), timeout=5) as client:
            assert _algorithm(client) == cc.host_default()
        assert quiet.status()["data_path"].startswith("host default (nosuchcc refused")


def test_text_that_names_no_algorithm_is_refused_at_import() -> None:
    env = {**os.environ, cc.ENV: "not an algorithm"}
    code = "import kvpool.transport.tcp_congestion"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "$KVPOOL_TCP_CONGESTION must name" in done.stderr


@needs_option
@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) not installed")
def test_the_nodes_data_server_and_its_client_run_it(chosen: str) -> None:
    """End to end: a data server's accepted connection and a client's, as ``ss`` (the
    kernel's own report) shows them, and bytes still move."""
    region = np.arange(1 << 20, dtype=np.uint8)
    with TcpDataServer(region, host="127.0.0.1", port=0) as server:
        _, port = server.start()
        conn = DataConn("127.0.0.1", port, None, 5, server.instance)
        try:
            out = np.zeros(4096, np.uint8)
            conn.read_one(4096, out)
            assert np.array_equal(out, region[4096:8192])
            assert _algorithm(conn.sock) == chosen
            shown = subprocess.run(
                ["ss", "-tin", "state", "established", f"( sport = :{port} )"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert f" {chosen} " in f" {shown.replace(chr(9), ' ')} "
        finally:
            conn.close()
