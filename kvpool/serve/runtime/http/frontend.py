"""The HTTP front end of ``kvpool serve``: OpenAI-style completions over the workers.

``Frontend`` puts the parts together; each lives in its own module:

- ``routes``: the Starlette app (``/v1/completions``, ``/v1/models``,
  ``/health``, ``/metrics``);
- ``openai``: request parsing and validation (4xx), response shaping, API errors;
- ``dispatch``: a request's life (route -> prefill, single worker or a
  pipeline group -> decode -> streamed tokens);
- ``fleet``: the worker processes (RPC clients, decode event pumps, load
  polling, supervision and restart, pipeline group linking);
- ``metrics``: Prometheus counters and scrape-time gauges;
- ``state``: settings, in-flight requests and worker handles.

A worker that dies fails its in-flight requests with 502 and is restarted
by the fleet's supervisor; requests route around it meanwhile.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.applications import Starlette

from kvpool.procs import Child
from kvpool.serve.runtime.http.dispatch import Dispatcher
from kvpool.serve.runtime.http.fleet import Launcher, WorkerFleet
from kvpool.serve.runtime.http.metrics import ServeMetrics
from kvpool.serve.runtime.http.routes import build_app
from kvpool.serve.runtime.http.state import ServeSettings
from kvpool.serve.sched.router_api import Router

if TYPE_CHECKING:
    from kvpool.api import KVStore


class Frontend:
    """Workers, routing, metrics and the ASGI app of one ``kvpool serve``."""

    def __init__(
        self,
        settings: ServeSettings,
        router: Router,
        launch: Launcher | None,
        pool: KVStore | None = None,
    ) -> None:
        self.settings = settings
        self.created = int(time.time())
        # the metrics read the fleet's states at scrape time; the fleet counts into them
        self.metrics = ServeMetrics(lambda: self.fleet.states(), pool)
        self.fleet = WorkerFleet(settings, launch, self.metrics)
        self.dispatch = Dispatcher(settings, router, self.fleet, self.metrics, pool)

    def add_worker(self, worker_id: str, kind: str, child: Child) -> None:
        self.fleet.add_worker(worker_id, kind, child)

    def start(self) -> None:
        """Link the pipeline groups and start the supervisor and load poller."""
        self.fleet.start()

    def close(self) -> None:
        self.fleet.close()

    def children(self) -> list[Child]:
        return self.fleet.children()

    def app(self) -> Starlette:
        return build_app(self.settings, self.fleet, self.dispatch, self.metrics, self.created)
