"""Servers facing unauthenticated peers: no large allocation before the hello,
a cap on connections, the UCX listener's address; master handlers that
never block their connection."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest

from kvpool.errors import InsecureBindError
from kvpool.rpc.client import RpcClient
from kvpool.rpc.frame import FRAME_VERSION, HEADER, MAGIC
from kvpool.rpc.server import Deferred, RpcServer, ServerConfig
from kvpool.transport import tcp_wire as w
from kvpool.transport.tcp_server import TcpDataServer


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the peer closed (or reset) the connection within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_an_unauthenticated_16_mib_length_prefix_is_refused_at_once() -> None:
    with RpcServer(ServerConfig(max_frame=16 << 20, handshake_timeout=10)) as server:
        server.start()
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(HEADER.pack(MAGIC, FRAME_VERSION, 0, (16 << 20) - 1))
            # closed long before the 10 s handshake timeout, the body never sent
            assert closed_within(sock, 3.0)
        with RpcClient(server.address, timeout=5) as rpc:  # still serving
            assert rpc.server_name == "kvpool"


def test_the_data_server_refuses_an_oversized_hello() -> None:
    with TcpDataServer(np.zeros(4096, np.uint8), handshake_timeout=10) as server:
        server.start()
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 60000, 0))
            assert closed_within(sock, 3.0)


def test_connection_cap_holds() -> None:
    with RpcServer(ServerConfig(max_connections=3)) as server:
        server.start()
        clients = [RpcClient(server.address, timeout=5) for _ in range(3)]
        time.sleep(0.1)
        with socket.create_connection(server.address, timeout=5) as extra:
            assert closed_within(extra, 3.0)
        clients.pop().close()
        time.sleep(0.2)
        with RpcClient(server.address, timeout=5) as again:
            assert again.server_name == "kvpool"
        for c in clients:
            c.close()


def test_data_server_connection_cap_holds() -> None:
    with TcpDataServer(np.zeros(4096, np.uint8), max_connections=2) as server:
        server.start()
        held = [socket.create_connection(server.address, timeout=5) for _ in range(2)]
        time.sleep(0.1)
        with socket.create_connection(server.address, timeout=5) as extra:
            assert closed_within(extra, 3.0)
        for s in held:
            s.close()


def test_a_deferred_handler_does_not_block_its_connection() -> None:
    """An inline handler that must wait on another server hands its finish to a
    worker: later calls on the same connection are answered meanwhile."""
    with RpcServer() as server:
        server.register("slow", lambda _p: Deferred(lambda: time.sleep(1.0) or "slow"), inline=True)
        server.register("fast", lambda _p: "fast", inline=True)
        server.start()
        with RpcClient(server.address, timeout=5) as rpc:
            slow = rpc.submit("slow")
            t0 = time.monotonic()
            assert rpc.call("fast") == "fast"
            assert time.monotonic() - t0 < 0.5
            assert rpc.wait(slow) == "slow"


def test_ucx_listener_address() -> None:
    """The UCX listener serves only the node's --host, or (a UCXX that cannot
    bind an address) refuses to start without a token."""
    pytest.importorskip("ucxx", reason="ucxx not installed (pip install kvpool[ucx])")
    from kvpool.transport.ucx import import_ucxx
    from kvpool.transport.ucx_server import UcxDataServer, listener_address

    region = np.zeros(4096, np.uint8)
    if listener_address(import_ucxx().create_listener, "127.0.0.1"):
        server = UcxDataServer(region, host="127.0.0.1")
        try:
            with socket.socket() as probe:  # not reachable on another local address
                probe.settimeout(1)
                other = socket.gethostbyname(socket.gethostname())
                if other != "127.0.0.1":
                    assert probe.connect_ex((other, server.port)) != 0
        finally:
            server.close()
    else:
        with pytest.raises(InsecureBindError):
            UcxDataServer(region, host="127.0.0.1", token=None)


def test_hello_frame_limit_is_a_few_kib() -> None:
    assert ServerConfig().hello_max_frame <= 16 << 10
    assert struct.calcsize("!HH") == w.HELLO_LENGTHS.size and w.MAX_HELLO_FIELD <= 4096


def test_node_only_methods_are_refused_to_clients() -> None:
    from kvpool.cluster.master import Master, MasterConfig
    from kvpool.cluster.wire import REGISTER, RegisterNode
    from kvpool.errors import PermissionDeniedError
    from kvpool.transport.base import RegionInfo

    master = Master(MasterConfig(port=0))
    master.start()
    try:
        with RpcClient(master.address, timeout=5, name="kvpool-client") as rpc:
            with pytest.raises(PermissionDeniedError):
                rpc.call(REGISTER, RegisterNode(RegionInfo(node_id="x", size=4096)))
            assert rpc.call("stats")["nodes"] == {}
    finally:
        master.close()
