"""The store an engine integration talks to, from the engine's JSON config.

Both engine bindings (``kvpool.bindings.vllm``, ``kvpool.bindings.sglang``)
take the same keys from their engine's "extra config" dict:

- ``url``: ``kvpool://HOST:PORT`` of a cluster's master (``kvpool.connect``);
  ``transport`` (``"shm"``/``"tcp"``/...) and ``timeout`` (seconds, default
  5) go with it;
- or ``embedded``: a dict of ``Pool.embedded`` arguments (``dram_bytes``,
  ``ssd_path``, ...) plus an optional ``name``, or ``true`` for the defaults.
  The pool is one per process and per argument set, so an engine whose
  scheduler and worker live in the same process shares it between them; it
  is closed (its shared memory unlinked) when the process exits.

Connecting is lazy and failure-tolerant: ``StoreHandle.get()`` answers None
while the pool cannot be reached (logged once per outage, retried after
``retry_s``), so an engine whose pool is down serves without it instead of
failing or hanging.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.errors import KVPoolError

if TYPE_CHECKING:
    from kvpool.api import KVStore

log = logging.getLogger("kvpool.bindings")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRY_S = 5.0

_embedded: dict[str, KVStore] = {}
_embedded_lock = threading.Lock()


@dataclass(frozen=True)
class StoreConfig:
    """Where the pool is: a cluster ``url`` or an ``embedded`` pool (exactly one)."""

    url: str | None = None
    embedded: Mapping[str, Any] | None = None
    transport: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    retry_s: float = DEFAULT_RETRY_S
    token: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, *, owner: str) -> StoreConfig:
        """Parse an engine's extra-config dict; ValueError names the bad key."""
        extra = dict(extra or {})
        url, embedded = extra.get("url"), extra.get("embedded")
        if (url is None) == (embedded is None or embedded is False):
            raise ValueError(
                f"{owner}: give exactly one of 'url' (kvpool://HOST:PORT) or 'embedded' "
                f"in the extra config, got {sorted(extra)}"
            )
        if url is not None and not isinstance(url, str):
            raise ValueError(f"{owner}: 'url' must be a string, got {url!r}")
        if embedded is True:
            embedded = {}
        if embedded is not None and not isinstance(embedded, Mapping):
            raise ValueError(f"{owner}: 'embedded' must be true or a dict, got {embedded!r}")
        timeout = _positive(extra.get("timeout", DEFAULT_TIMEOUT_S), "timeout", owner)
        retry_s = _positive(extra.get("retry_s", DEFAULT_RETRY_S), "retry_s", owner)
        return cls(
            url=url,
            embedded=dict(embedded) if embedded is not None else None,
            transport=extra.get("transport"),
            timeout=timeout,
            retry_s=retry_s,
            token=extra.get("token"),
            extra=extra,
        )

    def open(self) -> KVStore:
        """Connect (or find this process's embedded pool); raises on failure."""
        if self.embedded is not None:
            return embedded_pool(self.embedded)
        from kvpool.cluster.client.remote_pool import connect

        assert self.url is not None
        kw: dict[str, Any] = {"timeout": self.timeout, "token": self.token}
        if self.transport:
            kw["transport"] = self.transport
        return connect(self.url, **kw)


def embedded_pool(args: Mapping[str, Any]) -> KVStore:
    """The process-wide embedded pool made with ``Pool.embedded(**args)``."""
    from kvpool.embedded.pool import Pool

    name = json.dumps(dict(args), sort_keys=True)
    with _embedded_lock:
        pool = _embedded.get(name)
        if pool is None:
            if not _embedded:
                atexit.register(close_embedded_pools)
            pool_args = {k: v for k, v in args.items() if k != "name"}
            pool = _embedded[name] = Pool.embedded(**pool_args)
        return pool


def close_embedded_pools() -> None:
    """Close every embedded pool this process opened (at exit, and in tests)."""
    with _embedded_lock:
        pools = list(_embedded.values())
        _embedded.clear()
    for pool in pools:
        pool.close()


class StoreHandle:
    """A lazily opened store that reports an unreachable pool as None, never raises."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._store: KVStore | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._down_logged = False

    def get(self) -> KVStore | None:
        with self._lock:
            now = time.monotonic()
            if now < self._next_try:
                return None
            if self._store is not None:
                return self._store
            try:
                self._store = self.config.open()
            except (KVPoolError, OSError) as exc:
                self._next_try = now + self.config.retry_s
                if not self._down_logged:
                    log.warning("kvpool unreachable (%s); serving without it", exc)
                    self._down_logged = True
                return None
            self._down_logged = False
            return self._store

    def failed(self, exc: BaseException) -> None:
        """Note a failed call: ``get`` answers None for ``retry_s``, so an
        outage costs one timeout per ``retry_s``, not one per request."""
        with self._lock:
            self._next_try = time.monotonic() + self.config.retry_s
            if not self._down_logged:
                log.warning("kvpool call failed (%s); treating as a miss", exc)
                self._down_logged = True

    def ok(self) -> None:
        self._down_logged = False

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None and self.config.embedded is None:
            store.close()


def _positive(value: Any, name: str, owner: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{owner}: {name!r} must be a positive number, got {value!r}")
    return float(value)
