"""Pick the fastest transport that can reach a peer's region from this process.

Order (automatic): ``shm`` when the node runs on this host (same
``host_identity``) and its arena file maps; ``ucx`` when UCXX is installed and
both ends have an RDMA device (the node reports ``UcxInfo.rdma``; this host
lists one under /sys/class/infiniband) -- UCX over plain TCP is slower here
than our socket path, and CUDA alone does not make it faster; else ``tcp``.

``override`` (default ``$KVPOOL_TRANSPORT``) is a comma-separated preference
list, e.g. ``"tcp"`` or ``"ucx,tcp"``: the first that can reach the peer wins,
and ``TransportUnavailableError`` names why none could. A list naming a
transport that does not exist is refused when the client connects
(``check_override``), not at its first put.
"""

from __future__ import annotations

import os
import threading

from kvpool.errors import TransportUnavailableError
from kvpool.transport.base import RegionInfo, Transport

TRANSPORT_ENV = "KVPOOL_TRANSPORT"
NAMES = ("shm", "ucx", "tcp")


def _why_not(name: str, peer: RegionInfo) -> str | None:
    """None when ``name`` can reach ``peer``, else the reason it cannot."""
    if name == "shm":
        from kvpool.transport.shm import shm_reachable

        return (
            None if shm_reachable(peer) else "node is not on this host or its arena is not mapped"
        )
    if name == "tcp":
        return None if peer.tcp_port else "node serves no TCP data port"
    if name == "ucx":
        from kvpool.transport.ucx import ucx_available

        if not ucx_available():
            return "ucxx is not installed (pip install 'kvpool[ucx]')"
        return None if peer.ucx is not None else "node has no UCX listener"
    return _unknown(name)


def _names(override: str) -> list[str]:
    return [n.strip().lower() for n in override.split(",") if n.strip()]


def check_override(override: str | None = None) -> None:
    """Refuse, up front (a client checks at ``connect``, not at its first put), a
    preference list (``override``, else ``$KVPOOL_TRANSPORT``) that names a
    transport which does not exist, or names none: ``TransportUnavailableError``."""
    source = "transport"
    if override is None:
        override, source = os.environ.get(TRANSPORT_ENV) or None, f"${TRANSPORT_ENV}"
    if not override:
        return  # automatic
    names = _names(override)
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        why = _unknown(unknown[0] if unknown else "")
        raise TransportUnavailableError(f"{source}={override!r}: {why}")


def _unknown(name: str) -> str:
    return f"unknown transport {name!r} (choose from {', '.join(NAMES)})"


def candidates(peer: RegionInfo, override: str | None = None) -> list[str]:
    """Transport names to try, best first."""
    if override:
        return _names(override)
    names = ["shm"]
    if peer.ucx is not None and peer.ucx.rdma:
        from kvpool.transport.ucx import ucx_has_rdma

        if ucx_has_rdma():  # RDMA needs a device at both ends
            names.append("ucx")
    return [*names, "tcp"]


def select_transport(
    peer: RegionInfo,
    override: str | None = None,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    cancel: threading.Event | None = None,
) -> Transport:
    """A connected-on-demand Transport to ``peer``; see the module docstring.
    ``cancel``: see ``ShmTransport``."""
    if override is None:
        override = os.environ.get(TRANSPORT_ENV) or None
    reasons = []
    for name in candidates(peer, override):
        why = _why_not(name, peer)
        if why is not None:
            reasons.append(f"{name}: {why}")
            continue
        if name == "shm":
            from kvpool.transport.shm import ShmTransport

            try:
                return ShmTransport(peer, cancel)
            except TransportUnavailableError as exc:
                reasons.append(f"shm: {exc}")
                continue
        if name == "ucx":
            from kvpool.transport.ucx import UcxTransport

            return UcxTransport(peer, token=token, timeout=timeout)
        from kvpool.transport.tcp import TcpTransport

        return TcpTransport(peer, token=token, timeout=timeout)
    raise TransportUnavailableError(
        f"no transport reaches node {peer.node_id}: {'; '.join(reasons)}"
    )
