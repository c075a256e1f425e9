"""``Coordinator`` on a real etcd (v3 API through its JSON gateway, ``etcd3gw``).

etcd3gw speaks plain HTTP/JSON (no grpc, no protobuf), is synchronous and
small; it is pinned in the ``[ha]`` extra and imported only when a master
runs with ``--etcd``. etcd has no election call on that gateway that fits a
lease-bound term, so the campaign is one transaction: "if the key's
create_revision is 0, put it bound to my lease". The transaction's revision
is the key's creation revision: the new term's epoch.

Every request has a timeout (``timeout``, well under the lease TTL), and a
failed request moves to the next endpoint, so one dead etcd member does
not stall the renew loop past the self-fencing deadline.
"""

from __future__ import annotations

import base64
import contextlib
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool.cluster.ha.coordinator import Coordinator, Leader

T = TypeVar("T")


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """``http://h1:2379,h2:2379`` -> [(h1, 2379), (h2, 2379)]."""
    found = []
    for part in spec.split(","):
        part = part.strip().removeprefix("http://")
        if not part:
            continue
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint must be http://HOST:PORT, got {part!r}")
        found.append((host, int(port)))
    if not found:
        raise ValueError(f"no etcd endpoint in {spec!r}")
    return found


class EtcdCoordinator(Coordinator):
    def __init__(self, endpoints: str, *, timeout: float = 1.0) -> None:
        import etcd3gw  # the [ha] extra

        self._etcd3gw = etcd3gw
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self._at = 0
        self._lock = threading.Lock()
        self._clients: dict[int, Any] = {}
        self._lease: Any = None

    def _client(self) -> Any:
        with self._lock:
            i = self._at
            client = self._clients.get(i)
            if client is None:
                host, port = self.endpoints[i]
                client = self._etcd3gw.client(
                    host=host, port=port, timeout=self.timeout, api_path="/v3/"
                )
                self._clients[i] = client
            return client

    def _call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)``; on failure, move to the next endpoint and re-raise."""
        try:
            return fn(self._client())
        except Exception:
            with self._lock:
                self._at = (self._at + 1) % len(self.endpoints)
            raise

    def campaign(self, key: str, value: str, ttl: float) -> int | None:
        lease = self._call(lambda c: c.lease(ttl=max(1, math.ceil(ttl))))
        txn = {
            "compare": [
                {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            ],
            "success": [
                {"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease.id}}
            ],
            "failure": [],
        }
        reply = self._call(lambda c: c.transaction(txn))
        if not reply.get("succeeded"):
            with contextlib.suppress(Exception):
                self._call(lambda c: lease.revoke())
            return None
        self._lease = lease
        return int(reply["header"]["revision"])

    def renew(self) -> bool:
        lease = self._lease
        if lease is None:
            return False
        return bool(self._call(lambda c: lease.refresh()) > 0)

    def leader(self, key: str) -> Leader | None:
        found = self._call(lambda c: c.get(key, metadata=True))
        if not found:
            return None
        value, meta = found[0]
        raw = value.decode() if isinstance(value, bytes) else str(value)
        return Leader(raw, int(meta["create_revision"]))

    def resign(self, key: str) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(Exception):
                self._call(lambda c: lease.revoke())

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            session = getattr(client, "session", None)
            if session is not None:
                session.close()
