"""Prometheus metrics of the front end (``GET /metrics``).

``ServeMetrics`` holds the counters and histograms the request path and the
worker fleet update as things happen; ``StateCollector`` adds gauges read at
scrape time (each worker's load, the pool's stats), so they are never stale.
Each front end has its own registry: two in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from kvpool.serve.sched.router_api import WorkerState

if TYPE_CHECKING:
    from kvpool.api import KVStore

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0,
)  # fmt: skip


class ServeMetrics:
    """The front end's registry and the metrics updated as requests are served."""

    def __init__(
        self, states: Callable[[], list[WorkerState]], pool: KVStore | None = None
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvpool_serve_requests", "Completions answered, by HTTP status", ["status"], registry=r
        )
        self.rejected = Counter(
            "kvpool_serve_rejected", "Requests the router rejected (429)", registry=r
        )
        self.ttft = Histogram(
            "kvpool_serve_ttft_seconds",
            "Time to first token (request arrival to first token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tbt = Histogram(
            "kvpool_serve_tbt_seconds",
            "Time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvpool_serve_e2e_seconds",
            "Request latency (arrival to last token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("kvpool_serve_inflight_requests", "Requests in flight", registry=r)
        self.prompt_tokens = Counter(
            "kvpool_serve_prompt_tokens", "Prompt tokens prefilled", registry=r
        )
        self.cached_tokens = Counter(
            "kvpool_serve_prefix_hit_tokens",
            "Prompt tokens whose KV came from the pool",
            registry=r,
        )
        self.computed_tokens = Counter(
            "kvpool_serve_computed_prompt_tokens", "Prompt tokens run through the model", registry=r
        )
        self.generated = Counter(
            "kvpool_serve_generated_tokens", "Output tokens sent to clients", registry=r
        )
        self.pipeline = Counter(
            "kvpool_serve_pipeline_requests",
            "Requests prefilled by a pipeline group (--cpp-group)",
            ["group"],
            registry=r,
        )
        self.pipeline_failures = Counter(
            "kvpool_serve_pipeline_failures",
            "Pipeline prefills that failed (502)",
            ["group"],
            registry=r,
        )
        self.restarts = Counter(
            "kvpool_serve_worker_restarts", "Worker restarts", ["worker"], registry=r
        )
        self.worker_failures = Counter(
            "kvpool_serve_worker_failures",
            "Workers found dead or unreachable",
            ["worker"],
            registry=r,
        )
        r.register(StateCollector(states, pool))

    def text(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)


class StateCollector:
    """Scrape-time gauges: worker load and the pool's stats."""

    def __init__(self, states: Callable[[], list[WorkerState]], pool: KVStore | None) -> None:
        self.states = states
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:

        up = GaugeMetricFamily(
            "kvpool_serve_worker_up", "1 while the worker is live", labels=["worker", "kind"]
        )
        queued = GaugeMetricFamily(
            "kvpool_serve_worker_queued_requests",
            "Requests queued at the worker",
            labels=["worker", "kind"],
        )
        tokens = GaugeMetricFamily(
            "kvpool_serve_worker_queued_tokens",
            "Tokens queued at the worker",
            labels=["worker", "kind"],
        )
        running = GaugeMetricFamily(
            "kvpool_serve_worker_running",
            "Requests running at the worker",
            labels=["worker", "kind"],
        )
        kv_free = GaugeMetricFamily(
            "kvpool_serve_decode_kv_free_tokens",
            "Free KV slots of a decode worker",
            labels=["worker"],
        )
        for s in self.states():
            labels = [s.worker_id, s.kind]
            up.add_metric(labels, 1.0 if s.alive else 0.0)
            queued.add_metric(labels, s.queued_requests)
            tokens.add_metric(labels, s.queued_tokens)
            running.add_metric(labels, s.running)
            if s.kv_free_tokens is not None:
                kv_free.add_metric([s.worker_id], s.kv_free_tokens)
        yield from (up, queued, tokens, running, kv_free)
        if self.pool is None:
            return
        try:
            stats = self.pool.stats()
        except Exception:
            return
        for key, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"kvpool_pool_{key}", f"pool stats: {key}")
                g.add_metric([], float(value))
                yield g
        for section, label in (("tiers", "tier"), ("nodes", "node")):
            entries = stats.get(section)
            if not isinstance(entries, dict):
                continue
            fams: dict[str, GaugeMetricFamily] = {}
            for name, vals in entries.items():
                if not isinstance(vals, dict):
                    continue
                for key, value in vals.items():
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        fam = fams.get(key)
                        if fam is None:
                            fam = fams[key] = GaugeMetricFamily(
                                f"kvpool_pool_{label}_{key}",
                                f"pool stats per {label}: {key}",
                                labels=[label],
                            )
                        fam.add_metric([str(name)], float(value))
            yield from fams.values()
