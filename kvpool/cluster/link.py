"""The connection to the cluster's current master, riding through restarts and failovers.

A cluster has one master, or (HA, kvpool.cluster.ha) one leader and hot
standbys; clients and nodes are given every master's address
(``h1:p1,h2:p2``) and never need etcd. ``MasterLink.call`` sends a request
to the master it believes leads and, when the answer is that it cannot
serve now, retries until the failover deadline:

- connection lost, refused or timed out: the next address (in turn);
- ``NotLeaderError``: the leader it names (else the next address);
- ``MasterNotReadyError``: the same master, a little later (a new term
  waiting for nodes to re-register).

Past the deadline (default 10 s, ``$KVPOOL_FAILOVER_S``) it raises one
``MasterUnavailableError`` naming the last failure. Other remote errors
(bad arguments, a full pool) are raised at once.

Retrying is safe for every master method: allocations the client never
uses expire, a repeated commit answers False for an allocation already
committed, queries and releases are idempotent. ``submit`` (fire and
forget: revokes, grant refills) never retries.

Invariants: ``epoch`` is the highest master term this link has heard of
(callers report it with ``saw_epoch``); a reply from a lower term is a
deposed master's and is refused (``StaleEpochError``), so a client never
goes back to an older term. Once ``close`` ran, no connection is opened
again and a call still retrying stops at its next attempt with
``PoolClosedError`` (a background caller, such as the connect-time warm-up,
must not hold a closing client for the failover deadline).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvpool.args import parse_address
from kvpool.errors import (
    CallTimeoutError,
    ConnectionLostError,
    MasterNotReadyError,
    MasterUnavailableError,
    NotLeaderError,
    PoolClosedError,
    StaleEpochError,
)
from kvpool.rpc.client import RpcClient
from kvpool.rpc.messages import WireMessage

W = TypeVar("W", bound=WireMessage)
DEFAULT_FAILOVER_S = 10.0


def parse_masters(masters: str | tuple[str, int] | Sequence[str]) -> list[tuple[str, int]]:
    """``"h1:p1,h2:p2"``, a (host, port) pair or a list of ``host:port`` -> addresses."""
    if isinstance(masters, tuple) and len(masters) == 2 and isinstance(masters[1], int):
        return [parse_address(masters)]
    parts = masters.split(",") if isinstance(masters, str) else list(masters)
    found = [parse_address(p.strip()) for p in parts if str(p).strip()]
    if not found:
        raise ValueError(f"no master address in {masters!r}")
    return found


def failover_deadline(explicit: float | None = None) -> float:
    """Seconds a call keeps retrying: ``explicit``, else ``$KVPOOL_FAILOVER_S``, else 10."""
    if explicit is not None:
        value = explicit
    else:
        raw = os.environ.get("KVPOOL_FAILOVER_S", "")
        try:
            value = float(raw) if raw else DEFAULT_FAILOVER_S
        except ValueError:
            raise ValueError(f"KVPOOL_FAILOVER_S must be a number, got {raw!r}") from None
    if not 0 <= value < math.inf:  # also refuses nan: a call must end
        raise ValueError(f"the failover deadline must be >= 0 seconds (finite), got {value!r}")
    return value


def _epoch_of(reply: Any) -> int:
    """The master term a reply names (0: it names none)."""
    epoch = reply.get("epoch", 0) if isinstance(reply, dict) else getattr(reply, "epoch", 0)
    return epoch if isinstance(epoch, int) else 0


class MasterLink:
    """RPC to whichever of ``masters`` leads now; thread-safe."""

    def __init__(
        self,
        masters: str | tuple[str, int] | Sequence[str],
        *,
        token: str | None = None,
        timeout: float = 10.0,
        name: str = "",
        deadline: float | None = None,
        connect: bool = True,
    ) -> None:
        self.addresses = parse_masters(masters)
        self.token, self.timeout, self.name = token, timeout, name
        self.deadline = failover_deadline(deadline)
        self.epoch = 0
        self.failovers = 0  # calls that had to wait for a master (for stats)
        self._lock = threading.Lock()
        self._at = 0
        self._client: RpcClient | None = None
        self._closed = False
        if connect:  # some master must answer now (a wrong address fails fast)
            self._first_connect()

    @property
    def address(self) -> tuple[str, int]:
        return self.addresses[self._at]

    def saw_epoch(self, epoch: int) -> None:
        """A reply carried master term ``epoch``: refuse it if older than one seen."""
        if not epoch:
            return
        with self._lock:
            if epoch < self.epoch:
                raise StaleEpochError(f"master term {epoch} is older than term {self.epoch}")
            self.epoch = epoch

    def call(
        self,
        method: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        response_type: type[W] | None = None,
    ) -> Any:
        give_up = time.monotonic() + self.deadline
        pause = 0.02
        waited = False
        while True:
            client = None
            if self._closed:
                raise PoolClosedError(f"the link to {self._names()} is closed ({method})")
            try:
                client = self._connected()
                result = client.call(method, params, timeout=timeout)
                reply = response_type.from_dict(result) if response_type is not None else result
                self.saw_epoch(_epoch_of(reply))
                if waited:
                    self.failovers += 1
                return reply
            except NotLeaderError as exc:
                self._move(client, leader=str(exc).strip())
                last: Exception = exc
            except MasterNotReadyError as exc:
                last = exc
            except (OSError, CallTimeoutError, StaleEpochError) as exc:
                # OSError: ConnectionLostError, and resets during a handshake
                self._move(client)
                last = exc
            waited = True
            left = give_up - time.monotonic()
            if left <= 0:
                raise MasterUnavailableError(
                    f"no master of {self._names()} could serve {method} within "
                    f"{self.deadline:g} s (last: {last})"
                ) from last
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.25)

    def submit(self, method: str, params: Any = None) -> Future[Any]:
        """Send now, no retry (ConnectionLostError when no master is connected)."""
        return self._connected().submit(method, params)

    def skip(self) -> None:
        """Leave the current master for the next address (it answered from an old term)."""
        with self._lock:
            client = self._client
        self._move(client)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- helpers ---------------------------------------------------------------------

    def _first_connect(self) -> None:
        for _ in self.addresses:
            try:
                self._connected()
                return
            except OSError:
                if len(self.addresses) == 1:
                    raise
                self._move(None)
        raise ConnectionLostError(f"no master of {self._names()} accepts connections")

    def _connected(self) -> RpcClient:
        with self._lock:
            client = self._client
        if client is not None:
            return client
        if self._closed:
            raise ConnectionLostError(f"the link to {self._names()} is closed")
        address = self.address
        fresh = RpcClient(
            address,
            token=self.token,
            timeout=self.timeout,
            connect_timeout=min(self.timeout, 2.0),
            name=self.name,
        )
        with self._lock:
            if self._client is None and not self._closed:
                self._client = fresh
                return fresh
            client = self._client
        fresh.close()
        if client is None:  # closed meanwhile
            raise ConnectionLostError(f"the link to {self._names()} is closed")
        return client

    def _move(self, failed: RpcClient | None, leader: str = "") -> None:
        """Leave ``failed`` for the named leader, or the next address in turn."""
        with self._lock:
            if failed is not None and self._client is not failed:
                return  # another thread moved already
            old, self._client = self._client, None
            target = None
            if leader:
                try:
                    target = parse_address(leader)
                except ValueError:
                    target = None
            if target is not None and target in self.addresses:
                self._at = self.addresses.index(target)
            elif target is not None:
                self.addresses.append(target)
                self._at = len(self.addresses) - 1
            else:
                self._at = (self._at + 1) % len(self.addresses)
        if old is not None:
            old.close()

    def _names(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.addresses)
