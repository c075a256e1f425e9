"""Glue for the two ends: a node exposes its region, a client keeps one transport per node.

Node side::

    exposed = expose_region(arena.view, node_id="n1", shm_name=arena.name,
                            host=args.host, token=token)
    master.call("register", {"region": exposed.info.to_dict(), ...})
    ...
    exposed.close()

Client side::

    peers = PeerTransports(token=token)
    peers.get(RegionInfo.from_dict(placement["region"])).read_into(offset, out)
    peers.drop(node_id)          # after a ConnectionLostError: the next get reconnects
    peers.stats()                # {"shm": {"bytes_read": ..., ...}, "tcp": {...}}

Invariants: ``PeerTransports`` holds at most one transport per node id and
replaces it when the node re-registers with different ``RegionInfo`` (a
restarted node has a new arena and port); at most one thread builds a node's
transport at a time; byte counters of dropped transports are kept in ``stats()``;
once ``close`` began, ``get`` raises ``PoolClosedError`` and a transport whose
build was under way is closed, not kept (nothing outlives the close).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Any

from kvpool.bindings import stream_copy
from kvpool.errors import PoolClosedError
from kvpool.transport import shm_copy, tcp_congestion, tcp_recv
from kvpool.transport.base import RegionInfo, Transport, host_identity
from kvpool.transport.fencing import CommitDesk, WriteFence
from kvpool.transport.select import check_override, select_transport
from kvpool.transport.tcp_read_gate import ReadGate
from kvpool.transport.tcp_server import TcpDataServer

WILDCARDS = ("", "0.0.0.0", "::")


def advertised_host(bind_host: str) -> str:
    """The address clients should dial for a server bound to ``bind_host``."""
    if bind_host not in WILDCARDS:
        return bind_host
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # UDP connect sends nothing; picks the route
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()
    finally:
        probe.close()


@dataclass
class ExposedRegion:
    """A node's region being served; ``info`` is what the node advertises."""

    info: RegionInfo
    tcp: TcpDataServer
    ucx: Any = None  # UcxDataServer when UCX serves too

    def served(self) -> dict[str, tuple[int, int]]:
        """Payload bytes served so far per transport: {name: (out, in)}.

        Same-host clients copy through the mapped arena without this node
        seeing it: those bytes are counted by the clients' own transports
        (``PeerTransports.stats()``), never here.
        """
        out = {"tcp": (self.tcp.bytes_read, self.tcp.bytes_written)}
        if self.ucx is not None:
            out["ucx"] = (self.ucx.bytes_read, self.ucx.bytes_written)
        return out

    def close(self) -> None:
        self.tcp.close()
        if self.ucx is not None:
            self.ucx.close()


def expose_region(
    region: Any,
    *,
    node_id: str,
    shm_name: str = "",
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    ucx: bool | None = None,
    ucx_port: int = 0,
    fence: WriteFence | None = None,
    commits: CommitDesk | None = None,
    read_gate: ReadGate | None = None,
) -> ExposedRegion:
    """Serve ``region`` over TCP (and UCX: ``ucx=None`` means as ``$KVPOOL_UCX`` says,
    by default where UCXX and an RDMA device are present).

    ``shm_name`` is the /dev/shm file backing ``region`` ("" if it is not
    shared); same-host clients then map it instead of using a socket.
    ``fence`` checks stamped writes (kvpool.transport.fencing); ``commits`` takes
    the TCP writes whose writer asks the node to commit them; ``read_gate`` serves
    checked reads natively (kvpool.transport.tcp_read_gate).
    """
    tcp = TcpDataServer(
        region,
        host=host,
        port=port,
        token=token,
        fence=fence,
        commits=commits,
        read_gate=read_gate,
    )
    _, tcp_port = tcp.start()
    info = RegionInfo(
        node_id=node_id,
        size=tcp.size,
        host_id=host_identity(),
        tcp_host=advertised_host(host),
        tcp_port=tcp_port,
        tcp_instance=tcp.instance,
        tcp_node_commits=commits is not None,
        shm_name=shm_name,
    )
    ucx_server = None
    if ucx is None:
        from kvpool.transport.ucx import ucx_wanted

        ucx = ucx_wanted()
    if ucx:
        from kvpool.transport.ucx_server import UcxDataServer

        try:
            ucx_server = UcxDataServer(region, host=host, port=ucx_port, token=token, fence=fence)
        except BaseException:
            tcp.close()
            raise
        info.ucx = ucx_server.info()
        info.ucx.host = info.tcp_host
    return ExposedRegion(info, tcp, ucx_server)


class PeerTransports:
    """One lazily chosen transport per node; thread-safe."""

    def __init__(
        self, *, token: str | None = None, timeout: float = 10.0, override: str | None = None
    ) -> None:
        check_override(override)  # a misspelt name fails here, not at the first put
        self.token, self.timeout, self.override = token, timeout, override
        self._by_node: dict[str, Transport] = {}
        self._building: dict[str, threading.Lock] = {}  # per node: held while one is built
        self._retired: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        # Set by close() (under _lock): get() refuses, a build under way stops populating
        self._closed = threading.Event()

    def get(self, info: RegionInfo) -> Transport:
        """The node's transport, built on first use (or when its ``RegionInfo``
        changed). One thread builds a node's transport while the others asking for
        it wait and take it: building one maps and pre-faults the node's whole arena
        (same host) or connects; two threads building at once (a client's first put
        and its claim thread) each did that, on one CPU at twice the time, and one
        threw its copy away (first same-host put beside a 2 GiB arena: 0.41 s)."""
        node_id = info.node_id
        with self._lock:
            t = self._by_node.get(node_id)
            if t is not None and t.info == info:
                return t
            self._check_open()
            building = self._building.setdefault(node_id, threading.Lock())
        with building:
            with self._lock:  # built while this thread waited?
                self._check_open()
                old = self._by_node.get(node_id)
                if old is not None and old.info == info:
                    return old
            fresh = select_transport(
                info, self.override, token=self.token, timeout=self.timeout, cancel=self._closed
            )
            with self._lock:
                closed = self._closed.is_set()
                if not closed:
                    old = self._by_node.get(node_id)
                    self._by_node[node_id] = fresh
            if closed:  # close() ran while this one was built: it must not outlive it
                fresh.close()
                self._check_open()
        if old is not None:
            self._retire(old)
        return fresh

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise PoolClosedError("the node transports are closed")

    def drop(self, node_id: str) -> None:
        with self._lock:
            t = self._by_node.pop(node_id, None)
        if t is not None:
            self._retire(t)

    def _retire(self, t: Transport) -> None:
        t.close()
        with self._lock:
            acc = self._retired.setdefault(t.name, [0, 0])
            acc[0] += t.bytes_read
            acc[1] += t.bytes_written

    def stats(self) -> dict[str, dict[str, Any]]:
        """Bytes moved per transport name, live and retired transports together
        (shm also: each node's arena mapping's CUDA page-lock status, the host
        copy large blocks take: kvpool.bindings.stream_copy, and whether a read's
        checks and a put's seal go with the copy: kvpool.transport.shm_copy; tcp also: how its
        receives wait, kvpool.transport.tcp_recv, and the congestion control its
        connections run, kvpool.transport.tcp_congestion)."""
        with self._lock:
            out: dict[str, dict[str, Any]] = {
                k: {"bytes_read": v[0], "bytes_written": v[1]} for k, v in self._retired.items()
            }
            for t in self._by_node.values():
                acc = out.setdefault(t.name, {"bytes_read": 0, "bytes_written": 0})
                acc["bytes_read"] += t.bytes_read
                acc["bytes_written"] += t.bytes_written
                acc["peers"] = acc.get("peers", 0) + 1
                if t.page_lock_status is not None:
                    acc.setdefault("page_lock", {})[t.info.node_id] = t.page_lock_status
                if t.name == "shm":  # the copy its large blocks take, and its checks
                    acc["copy"] = stream_copy.status()
                    acc["checked_copy"] = shm_copy.STATUS
                elif t.name == "tcp":  # how its receives wait, its congestion control
                    acc["spin"] = {"status": tcp_recv.STATUS, **tcp_recv.counters()}
                    acc["congestion"] = tcp_congestion.CHOSEN.status()
            return out

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            nodes = list(self._by_node)
        for node_id in nodes:
            self.drop(node_id)
