"""Prometheus metrics for the master and storage nodes (``/metrics`` over HTTP).

Each process owns one registry (so tests can run several servers in one
process) and serves it with prometheus_client's own HTTP server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)


class Metrics:
    """The metric families kvpool servers export; unused families simply stay at zero."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.capacity = Gauge("kvpool_capacity_bytes", "Capacity", ["node"], registry=r)
        self.used = Gauge("kvpool_used_bytes", "Bytes in use", ["node"], registry=r)
        self.blocks = Gauge("kvpool_blocks", "Committed blocks", registry=r)
        self.nodes = Gauge("kvpool_nodes", "Live storage nodes", registry=r)
        self.granted = Gauge(
            "kvpool_granted_bytes", "Space lent to clients as put grants", registry=r
        )
        self.hits = Counter("kvpool_hits", "Blocks found by lookups", registry=r)
        self.misses = Counter("kvpool_misses", "Blocks not found by lookups", registry=r)
        self.evictions = Counter("kvpool_evictions", "Replicas evicted", registry=r)
        self.moved = Counter(
            "kvpool_bytes_moved", "Payload bytes moved", ["transport", "direction"], registry=r
        )
        self.latency = Histogram(
            "kvpool_op_seconds", "Operation latency", ["op"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.role = role
        self._server: Any = None
        self._moved_seen: dict[tuple[str, str], int] = {}

    def count_moved(self, transport: str, direction: str, total: int) -> None:
        """Advance ``kvpool_bytes_moved{transport, direction}`` to a running ``total``
        (a data server's own byte counter); a total that went down (a restarted
        server) counts from zero again."""
        seen = self._moved_seen.get((transport, direction), 0)
        delta = total - seen if total >= seen else total
        if delta:
            self.moved.labels(transport, direction).inc(delta)
        self._moved_seen[(transport, direction)] = total

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.latency.labels(op).observe(time.perf_counter() - start)

    def wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its latency recorded under ``op`` (the master wraps every RPC
        handler: the labelled child is looked up once, not per call)."""
        child = self.latency.labels(op)
        clock = time.perf_counter

        def timed_fn(*args: Any) -> Any:
            start = clock()
            try:
                return fn(*args)
            finally:
                child.observe(clock() - start)

        return timed_fn

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 picks a port); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
