"""Routing seam between the HTTP front end and the workers (the conductor plugs in here).

For every request the front end builds one ``WorkerState`` per live worker
and asks its ``Router``::

    decision = router.route(prompt_tokens, keys, workers)

``keys`` are the prompt's chained block keys in the model's namespace (the
same keys the pool stores, so a router can ask the pool which prefix is
cached and where). The decision names one prefill and one decode worker, or
carries a ``reject`` reason, which the front end answers with HTTP 429.
With ``kvpool serve --cpp-group k`` the prefill workers also form pipeline
groups of k (``WorkerState.group``/``stage``, set only while every member of
the group is live and linked); a decision may then name a ``group`` instead of
one prefill worker, and the prompt is prefilled by the group's stages
(``kvpool.serve.runtime.pipeline.pipeline_prefill``).
Workers of a kind that has none alive never reach the router: the front end
answers 503 itself.

A router may also implement ``observe(obs: Observation)``: the front end calls
it after every prefill and at the end of every request with what was
measured, so a cost model can fit itself to this machine.

The routers themselves and ``ROUTERS`` (``--router NAME``) are in
``kvpool.serve.sched.routing``; this module is only the API between them and
the front end, so both sides (and the conductor's router) import it without
importing each other. It imports neither torch nor the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvpool.serve.sched.presets import ModelConfig

PREFILL = "prefill"
DECODE = "decode"


@dataclass
class WorkerState:
    """A worker's load as the front end sees it when routing.

    ``queued_requests``/``queued_tokens``: requests sent to the worker and not
    finished with it (prefill: prompts waiting or computing; decode: requests
    waiting for KV memory or loading). ``running``: requests in the decode
    batch (prefill: the one computing). The counts are the front end's own
    (exact, updated as it dispatches) merged with the worker's last report
    (``reported``, refreshed a few times a second).
    """

    worker_id: str
    kind: str  # PREFILL or DECODE
    queued_requests: int = 0
    queued_tokens: int = 0
    running: int = 0
    address: str = ""
    alive: bool = True
    kv_free_tokens: int | None = None  # decode: free slots in its paged KV memory
    kv_capacity_tokens: int | None = None
    max_batch: int | None = None
    completed: int = 0  # requests this worker finished since it started
    group: str | None = None  # prefill: the ready pipeline group it is a stage of
    stage: int = 0  # ... and its position in it
    reported: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes: both workers, or a reason to reject it (HTTP 429).

    ``group``: prefill through that pipeline group (``prefill`` is then ignored)."""

    prefill: str | None = None
    decode: str | None = None
    reject: str | None = None
    group: str | None = None


@dataclass
class Observation:
    """What the front end measured, passed to ``Router.observe`` when a router has it.

    ``kind`` is ``"prefill"`` (after a prefill returned: ``seconds`` is its
    compute time on the worker, ``queue_seconds`` the time before it) or
    ``"request"`` (after the last token: ``ttft``/``tbt`` as the client saw them).
    """

    kind: str
    worker_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    seconds: float = 0.0
    queue_seconds: float = 0.0
    output_tokens: int = 0
    ttft: float | None = None
    tbt: list[float] = field(default_factory=list)
    decode_worker: str | None = None
    error: str | None = None


@runtime_checkable
class Router(Protocol):
    def route(
        self, prompt_tokens: int, keys: list[bytes], workers: list[WorkerState]
    ) -> RouteDecision: ...


@dataclass
class RouterContext:
    """What a router factory gets: the model, the pool and ``--router-opt`` values."""

    model: ModelConfig
    pool_url: str
    seed: int = 0
    options: dict[str, str] = field(default_factory=dict)
    cpp_min_tokens: int = 0  # --cpp-min-tokens (0: no pipeline groups)
    chunk_tokens: int = 512  # --chunk-tokens, the pipeline's chunk


#: The decision when a kind has no live worker (the front end answers 503).
NO_LIVE_WORKERS = RouteDecision(reject="no live worker of each kind")


def live_workers(workers: list[WorkerState]) -> tuple[list[WorkerState], list[WorkerState]]:
    """(live prefill workers, live decode workers), in the order given."""
    prefill = [w for w in workers if w.kind == PREFILL and w.alive]
    decode = [w for w in workers if w.kind == DECODE and w.alive]
    return prefill, decode


def pipeline_groups(workers: list[WorkerState]) -> dict[str, list[WorkerState]]:
    """Ready pipeline groups among ``workers``: id -> live members in stage order."""
    groups: dict[str, list[WorkerState]] = {}
    for w in workers:
        if w.kind == PREFILL and w.alive and w.group:
            groups.setdefault(w.group, []).append(w)
    return {g: sorted(m, key=lambda w: w.stage) for g, m in sorted(groups.items())}
