"""The routers of ``kvpool serve --router NAME`` and how one is picked.

``kvpool serve --router NAME [--router-opt KEY=VALUE ...]`` picks
``ROUTERS[NAME](RouterContext(...))``. To add a router, add one entry to
``ROUTERS`` (a factory taking a ``RouterContext``). The API a router
implements (``Router``, ``WorkerState``, ``RouteDecision``, ``Observation``)
is ``kvpool.serve.sched.router_api``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.serve.sched.conductor_router import conductor_from_context
from kvpool.serve.sched.router_api import (
    NO_LIVE_WORKERS,
    RouteDecision,
    Router,
    RouterContext,
    WorkerState,
    live_workers,
    pipeline_groups,
)


class LeastLoadedRouter:
    """Prefill: fewest queued tokens; decode: fewest requests (running + queued).

    Ties go to the lower worker id. Options: ``max_queued_tokens`` (reject
    when every prefill worker already has at least this many tokens queued;
    0, the default, never rejects). ``cpp_min_tokens`` (``--cpp-min-tokens``):
    prompts of at least this many tokens go to the ready pipeline group whose
    busiest member has the fewest queued tokens (a plain token threshold: this
    router has no TTFT estimate; 0 never pipelines).
    """

    name = "least-loaded"

    def __init__(self, max_queued_tokens: int = 0, cpp_min_tokens: int = 0) -> None:
        self.max_queued_tokens = max_queued_tokens
        self.cpp_min_tokens = cpp_min_tokens

    @classmethod
    def from_context(cls, ctx: RouterContext) -> LeastLoadedRouter:
        return cls(
            max_queued_tokens=int(ctx.options.get("max_queued_tokens", 0)),
            cpp_min_tokens=ctx.cpp_min_tokens,
        )

    def route(
        self, prompt_tokens: int, keys: list[bytes], workers: list[WorkerState]
    ) -> RouteDecision:
        prefill, decode = live_workers(workers)
        if not prefill or not decode:
            return NO_LIVE_WORKERS
        p = min(prefill, key=lambda w: (w.queued_tokens, w.queued_requests, w.worker_id))
        if self.max_queued_tokens and p.queued_tokens >= self.max_queued_tokens:
            return RouteDecision(
                reject=f"every prefill worker has >= {self.max_queued_tokens} tokens queued"
            )
        d = min(
            decode,
            key=lambda w: (w.running + w.queued_requests, w.queued_tokens, w.worker_id),
        )
        groups = pipeline_groups(prefill)
        if self.cpp_min_tokens and prompt_tokens >= self.cpp_min_tokens and groups:
            g = min(
                groups,
                key=lambda g: (
                    max(m.queued_tokens for m in groups[g]),
                    sum(m.queued_tokens for m in groups[g]),
                    g,
                ),
            )
            return RouteDecision(group=g, decode=d.worker_id)
        return RouteDecision(prefill=p.worker_id, decode=d.worker_id)


RouterFactory = Callable[[RouterContext], Router]

ROUTERS: dict[str, RouterFactory] = {
    "least-loaded": LeastLoadedRouter.from_context,
    "conductor": conductor_from_context,
}


def make_router(name: str, ctx: RouterContext) -> Router:
    try:
        factory = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose from {sorted(ROUTERS)}") from None
    return factory(ctx)


def parse_options(items: list[str] | None) -> dict[str, str]:
    """``["k=v", ...]`` -> dict (``--router-opt`` values)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"router option must be KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out
