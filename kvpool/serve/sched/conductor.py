"""The conductor: cache-aware, SLO-aware routing of a prefill.

One scheduling core drives both the live server (``ConductorRouter`` in
``kvpool.serve.sched.conductor_router``, the ``"conductor"`` entry of
``kvpool.serve.sched.routing.ROUTERS``) and the cluster simulator
(``kvpool.serve.sched.sim``). Admission (which requests to reject) is in
``kvpool.serve.sched.admission``.

Routing (``Conductor.choose``): for each prefill worker, with ``local`` =
leading blocks of the prompt cached on the worker's node and ``best`` = the
longest prefix any node holds (on node ``best_node``)::

    if local >= balance_threshold * best  (own prefix close enough):
        reuse local, recompute the rest here
    else (fetch from best_node, when worth it: transfer < compute it saves):
        transfer best - local blocks, reuse best, recompute the rest
    TTFT = queue + transfer + prefill(new = prompt - reused, cached = reused)

and the worker with the minimum estimated TTFT wins (ties: lower queue, then
worker order). A routed fetch replicates those hot blocks onto the chosen
worker's node (``pool.replicate(keys, node=...)``; in the simulator, the
blocks enter that node's cache).

SLOs are multiples of a request's unloaded latency: TTFT SLO = ``ttft_mult``
x prefill time of the whole prompt on an idle worker with nothing cached;
TBT SLO = ``tbt_mult`` x the step time of a decode batch holding only this
request. A request meets an SLO when its latency (TTFT) or the 90th
percentile of its gaps between tokens (TBT) stays within it.

Baseline routers (``BASELINES``): ``random``, ``least-loaded`` (shortest
predicted queue) and ``cache-only`` (longest local prefix); they never fetch.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpool.serve.sched.cost_model import (
    DecodeCostModel,
    PrefillCostModel,
    TransferModel,
)


@dataclass(frozen=True)
class SLO:
    """SLOs as multiples of a request's unloaded latency (P90 for TBT)."""

    ttft_mult: float = 10.0
    tbt_mult: float = 5.0
    percentile: float = 90.0


@dataclass(frozen=True)
class WorkerView:
    """What the conductor needs to know about one prefill worker for one request."""

    worker_id: str
    queue_s: float  # predicted wait before this worker can start the request
    local_blocks: int  # leading blocks of the prompt cached on the worker's node
    node: str | None = None  # the pool node next to the worker (fetch destination)


@dataclass(frozen=True)
class PrefillPlan:
    """One worker's estimate for one request (the chosen one is the route)."""

    worker_id: str
    ttft_s: float
    queue_s: float
    transfer_s: float
    prefill_s: float
    reused_blocks: int  # blocks whose KV is not recomputed
    local_blocks: int
    fetch_from: str | None = None  # node to copy blocks [local_blocks, reused_blocks) from
    node: str | None = None

    @property
    def fetch_blocks(self) -> int:
        return self.reused_blocks - self.local_blocks if self.fetch_from is not None else 0


def prefix_by_node(locations: Sequence[Sequence[str]]) -> dict[str, int]:
    """Leading blocks each node holds, from ``pool.locate(keys)``: {node: blocks}."""
    out: dict[str, int] = {}
    alive: set[str] | None = None
    for i, nodes in enumerate(locations):
        here = set(nodes)
        alive = here if alive is None else alive & here
        for n in alive:
            out[n] = i + 1
        if not alive:
            break
    return out


def best_prefix(
    views: Iterable[WorkerView], extra: dict[str, int] | None = None
) -> tuple[int, str | None]:
    """The longest prefix (blocks, node) among the workers' nodes and ``extra`` nodes."""
    best, where = 0, None
    for v in views:
        if v.local_blocks > best:
            best, where = v.local_blocks, v.node or v.worker_id
    for node, blocks in (extra or {}).items():
        if blocks > best:
            best, where = blocks, node
    return best, where


class Conductor:
    """TTFT estimates per prefill worker, the routing choice and SLO checks."""

    def __init__(
        self,
        prefill: PrefillCostModel,
        *,
        block_tokens: int,
        kv_bytes_per_token: int,
        transfer: TransferModel | None = None,
        decode: DecodeCostModel | None = None,
        slo: SLO | None = None,
        balance_threshold: float = 0.8,
    ) -> None:
        if not 0.0 <= balance_threshold <= 1.0:
            raise ValueError("balance_threshold must be in [0, 1]")
        self.prefill = prefill
        self.block_tokens = block_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.transfer = transfer or TransferModel()
        self.decode = decode
        self.slo = slo or SLO()
        self.balance_threshold = balance_threshold

    # -- SLOs ----------------------------------------------------------------------

    def ttft_slo(self, prompt_tokens: int) -> float:
        return self.slo.ttft_mult * self.prefill.unloaded_ttft(prompt_tokens)

    def tbt_slo(self, context_tokens: int) -> float:
        if self.decode is None:
            raise ValueError("no decode cost model: TBT SLO unknown")
        return self.slo.tbt_mult * self.decode.unloaded_tbt(context_tokens)

    # -- estimates -----------------------------------------------------------------

    def reusable_blocks(self, prompt_tokens: int, blocks: int) -> int:
        """Blocks of a cached prefix actually reused (at least one token is computed)."""
        full = prompt_tokens // self.block_tokens
        blocks = min(blocks, full)
        if blocks * self.block_tokens >= prompt_tokens:
            blocks = max(0, (prompt_tokens - 1) // self.block_tokens)
        return max(blocks, 0)

    def plan(
        self,
        worker: WorkerView,
        prompt_tokens: int,
        best_blocks: int,
        best_node: str | None,
        *,
        fetch: bool = True,
    ) -> PrefillPlan:
        """TTFT estimate for ``worker``: recompute beyond its own prefix, or fetch the best."""
        bt = self.block_tokens
        local = self.reusable_blocks(prompt_tokens, worker.local_blocks)
        best = self.reusable_blocks(prompt_tokens, best_blocks)
        local_prefill = self.prefill.predict(prompt_tokens - local * bt, local * bt)
        plan = PrefillPlan(
            worker_id=worker.worker_id,
            ttft_s=worker.queue_s + local_prefill,
            queue_s=worker.queue_s,
            transfer_s=0.0,
            prefill_s=local_prefill,
            reused_blocks=local,
            local_blocks=local,
            node=worker.node,
        )
        if (
            not fetch
            or best <= local
            or best_node is None
            or best_node == (worker.node or worker.worker_id)
            or local >= self.balance_threshold * best
        ):
            return plan
        transfer = self.transfer.seconds((best - local) * bt * self.kv_bytes_per_token)
        fetched_prefill = self.prefill.predict(prompt_tokens - best * bt, best * bt)
        if transfer + fetched_prefill >= local_prefill:  # not worth it
            return plan
        return PrefillPlan(
            worker_id=worker.worker_id,
            ttft_s=worker.queue_s + transfer + fetched_prefill,
            queue_s=worker.queue_s,
            transfer_s=transfer,
            prefill_s=fetched_prefill,
            reused_blocks=best,
            local_blocks=local,
            fetch_from=best_node,
            node=worker.node,
        )

    def plans(
        self, prompt_tokens: int, workers: Sequence[WorkerView], extra: dict[str, int] | None = None
    ) -> list[PrefillPlan]:
        best, where = best_prefix(workers, extra)
        return [self.plan(w, prompt_tokens, best, where) for w in workers]

    def choose(
        self, prompt_tokens: int, workers: Sequence[WorkerView], extra: dict[str, int] | None = None
    ) -> PrefillPlan:
        """The minimum-TTFT plan (ties: shorter queue, then the earlier worker)."""
        if not workers:
            raise ValueError("no prefill workers")
        candidates = self.plans(prompt_tokens, workers, extra)
        return min(enumerate(candidates), key=lambda ip: (ip[1].ttft_s, ip[1].queue_s, ip[0]))[1]

    def meets_ttft(self, plan: PrefillPlan, prompt_tokens: int) -> bool:
        return plan.ttft_s <= self.ttft_slo(prompt_tokens)


# -- baseline routers ---------------------------------------------------------------


def _no_fetch(conductor: Conductor, w: WorkerView, prompt_tokens: int) -> PrefillPlan:
    return conductor.plan(w, prompt_tokens, 0, None, fetch=False)


def route_random(
    conductor: Conductor, prompt_tokens: int, workers: Sequence[WorkerView], rng: _random.Random
) -> PrefillPlan:
    return _no_fetch(conductor, workers[rng.randrange(len(workers))], prompt_tokens)


def route_least_loaded(
    conductor: Conductor, prompt_tokens: int, workers: Sequence[WorkerView], rng: _random.Random
) -> PrefillPlan:
    i = min(range(len(workers)), key=lambda j: (workers[j].queue_s, j))
    return _no_fetch(conductor, workers[i], prompt_tokens)


def route_cache_only(
    conductor: Conductor, prompt_tokens: int, workers: Sequence[WorkerView], rng: _random.Random
) -> PrefillPlan:
    i = min(range(len(workers)), key=lambda j: (-workers[j].local_blocks, workers[j].queue_s, j))
    return _no_fetch(conductor, workers[i], prompt_tokens)


def route_conductor(
    conductor: Conductor, prompt_tokens: int, workers: Sequence[WorkerView], rng: _random.Random
) -> PrefillPlan:
    return conductor.choose(prompt_tokens, workers)


RouteFn = Callable[[Conductor, int, Sequence[WorkerView], _random.Random], PrefillPlan]

BASELINES: dict[str, RouteFn] = {
    "random": route_random,
    "least-loaded": route_least_loaded,
    "cache-only": route_cache_only,
}
ROUTE_FNS: dict[str, RouteFn] = {"conductor": route_conductor, **BASELINES}
