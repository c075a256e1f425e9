"""The TCP congestion control of the data path's connections, chosen before they exist.

The data path (``kvpool.transport.tcp``: client connections, the node's data
server) opens its sockets here: ``connect`` sets the algorithm on a client's
socket before it connects, ``listen`` on the data server's listener before it
accepts, so every connection starts under it (an accepted connection takes
its listener's at its handshake). Set after the handshake it would come too
late: a connection that started under BBR kept BBR's packet pacing when
switched to cubic, and its 4 MiB reads over loopback ran at 3.0-3.7 GB/s with
156 retransmissions against 5.1-5.3 GB/s and none when cubic was set before
connect.

Why choose at all (issue 17, session 27): these machines' default is BBR.
Over loopback BBR paces a reply's packets from timers that fire on either
CPU, the packets arrive out of order, TCP retransmits some and halves its
window: a raw socket streaming eight 64 KiB ranges fell from 2.7-3.1 GB/s to
1.2-1.4 GB/s once a few 1 MiB transfers had run on the connection, and
kvpool's 4 MiB and 16 MiB reads ran at 2.6-3.2 GB/s. With cubic on the data
path's sockets (and the raw baseline's: the benchmarks open theirs here too)
both ran at 5-6 GB/s (bench/RESULTS.md, "Session 27"). A storage data path
inside a cluster wants the window to grow and stay grown, which is cubic's
default behaviour; BBR's strengths (a bottleneck far away, shallow buffers)
are a wide-area network's.

``$KVPOOL_TCP_CONGESTION``, read once at import:
- unset or blank: ``cubic``, best effort: where the kernel refuses it (or the
  platform has no ``TCP_CONGESTION``), sockets keep the host's default and
  ``status()`` says so;
- ``system``: the host's default (``net.ipv4.tcp_congestion_control``);
- another name: that algorithm; one the kernel refuses fails the first data
  connection with ``TransportUnavailableError`` naming the variable and the
  algorithms the kernel offers. Anything that cannot be such a name is
  refused at import (``ValueError`` naming the variable).

RPC connections (master, small messages) keep the host's default.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass

from kvpool.errors import TransportUnavailableError
from kvpool.rpc import frame

log = logging.getLogger("kvpool.transport")

ENV = "KVPOOL_TCP_CONGESTION"
DEFAULT = "cubic"
SYSTEM = "system"
_NAME = re.compile(r"^[a-z0-9_]{1,15}$")  # the kernel's names: at most 15 bytes
_OPTION: int | None = getattr(socket, "TCP_CONGESTION", None)  # Linux only
_PROC = "/proc/sys/net/ipv4/tcp_{}congestion_control"


def parse(text: str | None) -> str | None:
    """The algorithm ``$KVPOOL_TCP_CONGESTION``'s text names: ``DEFAULT`` when unset
    or blank, None for ``system`` (the host's default); ValueError naming the
    variable for text that is no algorithm's name."""
    text = (text or "").strip()
    if not text:
        return DEFAULT
    if text == SYSTEM:
        return None
    if not _NAME.match(text):
        raise ValueError(
            f"${ENV} must name a TCP congestion control algorithm (e.g. cubic) or be "
            f"{SYSTEM!r}, got {text!r}"
        )
    return text


def host_default() -> str | None:
    """The host's default algorithm (None where the kernel does not say)."""
    return _read_proc("")


def offered() -> list[str]:
    """The algorithms the kernel offers (empty where it does not say)."""
    return (_read_proc("available_") or "").split()


def _read_proc(which: str) -> str | None:
    try:
        with open(_PROC.format(which)) as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass
class Congestion:
    """One choice of algorithm (``name``; None: the host's default) and how a refusal
    ends: an ``explicit`` choice raises, the default is best effort (``refused`` says
    why the kernel refused it; its sockets then keep the host's default)."""

    name: str | None
    explicit: bool
    refused: str = ""

    @classmethod
    def from_env(cls) -> Congestion:
        text = os.environ.get(ENV, "")
        name = parse(text)
        return cls(name, explicit=name is not None and bool(text.strip()))

    def apply(self, sock: socket.socket) -> None:
        """Set the algorithm on ``sock`` (before it connects or listens)."""
        if self.name is None or _OPTION is None or self.refused:
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _OPTION, self.name.encode())
        except OSError as exc:
            if self.explicit:
                raise TransportUnavailableError(
                    f"${ENV}={self.name}: the kernel refuses it ({exc.strerror}); it offers "
                    f"{' '.join(offered()) or 'none it lists'} ({SYSTEM!r}: the host's default)"
                ) from exc
            self.refused = exc.strerror or str(exc)
            log.info("TCP data path keeps the host's congestion control: %s", self.refused)

    def status(self) -> dict[str, str | None]:
        """What the data path's connections use, and the host's default."""
        if self.name is None:
            used = "host default"
        elif _OPTION is None:
            used = "host default (no TCP_CONGESTION on this platform)"
        elif self.refused:
            used = f"host default ({self.name} refused: {self.refused})"
        else:
            used = self.name
        return {"data_path": used, "host_default": host_default()}


CHOSEN = Congestion.from_env()


def connect(address: tuple[str, int], timeout: float | None) -> socket.socket:
    """A TCP connection to ``address`` under the chosen algorithm (``socket.
    create_connection``'s address resolution and ``timeout``; the last error of
    the addresses tried propagates)."""
    error: OSError | None = None
    host, port = address
    for family, kind, proto, _, where in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            CHOSEN.apply(sock)
            sock.settimeout(timeout)
            sock.connect(where)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
        except BaseException:
            sock.close()
            raise
    raise error if error is not None else OSError(f"no address for {host}:{port}")


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (``kvpool.rpc.frame.listen``) whose accepted
    connections run under the chosen algorithm: set on the listener, which every
    connection it accepts takes at its handshake."""
    sock = frame.listen(host, port)
    try:
        CHOSEN.apply(sock)
    except BaseException:
        sock.close()
        raise
    return sock
