"""The data-path interface: a node exposes a region, a client transport moves bytes.

A storage node owns one contiguous memory region (its DRAM arena) and
advertises how to reach it as a ``RegionInfo`` (sent to the master at
registration and handed to clients with every placement). A client turns a
``RegionInfo`` into a ``Transport`` with ``select_transport`` and then calls
``read_into(offset, out)`` / ``write(offset, data)``.

Invariants every transport keeps:
- ``read_into`` fills exactly ``nbytes(out)`` bytes or raises; ``write``
  stores exactly ``nbytes(data)`` bytes or raises; a raise may leave the
  destination range partially written (the two-phase put makes that safe);
- ranges outside ``[0, region size)`` are refused before any byte moves;
- no call blocks past the transport's timeout (``CallTimeoutError``); a dead
  peer raises ``ConnectionLostError`` (both ConnectionError/TimeoutError
  subclasses, so callers can fall back to another replica);
- payload bytes are never copied into intermediate ``bytes`` objects.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from kvpool.errors import BufferSpecError
from kvpool.rpc.messages import WireMessage


@cache
def host_identity() -> str:
    """Identity of this machine *and* network namespace.

    Two processes may share memory files only when this matches: same boot
    (``boot_id``), same hostname, same network namespace (processes in two
    netns joined by veth are treated as two hosts, as in the two-host test).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "?"
    return f"{socket.gethostname()}/{boot}/{netns}"


@dataclass
class UcxInfo(WireMessage):
    """How to reach a node's UCX worker: listener (host, port) and worker address."""

    host: str
    port: int
    worker_address: bytes = b""
    rdma: bool = False  # UCX found RDMA/GPU transports (only then UCX beats our TCP)


@dataclass
class RegionInfo(WireMessage):
    """A node's advertised memory region and the ways to reach it."""

    node_id: str
    size: int
    host_id: str = ""  # host_identity() of the node's process
    tcp_host: str = ""  # data port of the TCP transport ("" = not served)
    tcp_port: int = 0
    shm_name: str = ""  # file name under /dev/shm of the arena ("" = not shared)
    ucx: UcxInfo | None = None
    control_port: int = 0  # the node's own RPC server (SSD tier commands), on tcp_host
    ssd_bytes: int = 0  # capacity of the node's SSD tier (0 = none)
    tcp_instance: str = ""  # the TCP data server's incarnation id (checked in its handshake)
    tcp_node_commits: bool = False  # takes WRITE_COMMIT: the node commits such writes (tcp_wire)


class Transport(ABC):
    """Moves bytes between local buffers and one peer's region; thread-safe."""

    name: str = "?"

    def __init__(self, info: RegionInfo) -> None:
        self.info = info
        self.bytes_read = 0  # payload bytes moved by successful calls (for stats())
        self.bytes_written = 0

    @abstractmethod
    def read_into(self, offset: int, out: Any) -> None:
        """Copy region[offset : offset + nbytes(out)] into ``out`` (any writable buffer)."""

    @abstractmethod
    def write(self, offset: int, data: Any) -> None:
        """Copy ``data`` (any contiguous buffer) to region[offset : offset + nbytes(data)]."""

    def read_many(self, items: Sequence[tuple[int, Any]]) -> None:
        """Batch ``read_into``; transports with a request/response wire pipeline it."""
        for offset, out in items:
            self.read_into(offset, out)

    def write_many(self, items: Sequence[tuple[int, Any]]) -> None:
        for offset, data in items:
            self.write(offset, data)

    @property
    def page_lock_status(self) -> str | None:
        """How the peer's mapped region is page-locked for CUDA copies (shm only;
        see kvpool.storage.page_lock); None where the transport maps nothing."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release sockets/mappings; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_range(offset: int, length: int, size: int) -> None:
    if offset < 0 or length < 0 or offset + length > size:
        raise BufferSpecError(
            f"range [{offset}, {offset + length}) lies outside the region of {size} B"
        )
