"""The conductor: cache-aware, SLO-aware routing and admission.

One scheduling core drives both the live server (``ConductorRouter``, the
``"conductor"`` entry of ``kvpool.serve.sched.routing.ROUTERS``) and the cluster
simulator (``kvpool.serve.sched.sim.cluster``).

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

Admission (``Rejection``):

- ``none``: admit everything;
- ``now`` (alias ``early``, "early rejection"): at arrival, reject when no
  prefill worker meets the TTFT SLO, or when the decode pool's load *now*
  is at its capacity;
- ``after``: reject when no worker meets the TTFT SLO; otherwise only after
  prefill, when the decode pool cannot take the request (prefill wasted);
- ``predicted``: at arrival, reject when no worker meets the TTFT SLO, or
  when the decode load *predicted for the moment this request's prefill
  finishes* would be at capacity. The prediction is system-level
  (``DecodeLoadPredictor``): every request decodes for one uniform time
  ``D`` (a running mean of observed decode times), so the load at time t is
  the number of admitted requests whose decode interval [start, start + D)
  contains t — requests decoding now that will have finished drop out,
  requests still in prefill queues enter at their predicted prefill end.

The decode pool's capacity (``decode_capacity``) is the number of requests
it can hold at the mean request size: within its KV memory and with the
step time within the TBT SLO. Admission aims at ``headroom`` (0.9) of it:
at full KV memory the llama2-70b step time is already at the TBT SLO, so
admitting up to 100 % lets the admitted requests miss it.

Baseline routers (``BASELINES``): ``random``, ``least-loaded`` (shortest
predicted queue) and ``cache-only`` (longest local prefix); they never fetch.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import random as _random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.serve.sched.cost_model import (
    DecodeCostModel,
    PrefillCostModel,
    TransferModel,
)

REJECTIONS = ("none", "now", "early", "after", "predicted")
ROUTER_NAMES = ("conductor", "random", "least-loaded", "cache-only")


def normalize_rejection(name: str) -> str:
    """Canonical policy name (``early`` is ``now``); ValueError on unknown names."""
    if name not in REJECTIONS:
        raise ValueError(f"unknown rejection policy {name!r}; choose from {', '.join(REJECTIONS)}")
    return "now" if name == "early" else name


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


# -- decode admission -----------------------------------------------------------------


class DecodeLoadPredictor:
    """System-level decode load prediction with one uniform decode time per request.

    Requests are registered when admitted with their predicted prefill end
    (``add(rid, start)``: pending, in prefill), moved to the decode side when
    they actually start decoding (``start(rid, t)``), and dropped when they
    finish or are rejected (``remove``). Every request is assumed to decode
    for ``decode_s`` seconds (the mean of the observed decode times,
    ``observe``), so the load predicted for time T is anchored at the load
    measured now and projected forward::

        load(T) = load_now + pending requests whose prefill ends by T
                           - decoding requests whose start + decode_s falls in (now, T]

    Starts are kept sorted, so each prediction is O(log n).
    """

    def __init__(self, decode_s: float) -> None:
        if decode_s <= 0:
            raise ValueError("decode_s must be positive")
        self.decode_s = decode_s
        self.observed = 0
        self._pending: list[tuple[float, int]] = []
        self._running: list[tuple[float, int]] = []
        self._where: dict[int, tuple[bool, float]] = {}  # rid -> (running?, start)

    def __len__(self) -> int:
        return len(self._where)

    def _drop(self, rid: int) -> None:
        entry = self._where.pop(rid, None)
        if entry is None:
            return
        running, t = entry
        lst = self._running if running else self._pending
        i = bisect.bisect_left(lst, (t, rid))
        if i < len(lst) and lst[i] == (t, rid):
            del lst[i]

    def add(self, rid: int, start: float) -> None:
        """``rid`` is in prefill; its decode is predicted to start at ``start``."""
        self._drop(rid)
        self._where[rid] = (False, start)
        bisect.insort(self._pending, (start, rid))

    def start(self, rid: int, t: float) -> None:
        """``rid`` started decoding at ``t``."""
        self._drop(rid)
        self._where[rid] = (True, t)
        bisect.insort(self._running, (t, rid))

    def remove(self, rid: int) -> None:
        self._drop(rid)

    def pending_by(self, t: float) -> int:
        return bisect.bisect_right(self._pending, (t, float("inf")))

    def finishing(self, now: float, t: float) -> int:
        """Decoding requests predicted to finish in (now, t]."""
        d = self.decode_s
        lo = bisect.bisect_right(self._running, (now - d, float("inf")))
        hi = bisect.bisect_right(self._running, (t - d, float("inf")))
        return max(0, hi - lo)

    def predict(self, now: float, t: float, load_now: int) -> int:
        """Decode load predicted for time ``t`` (>= now) given the load measured now."""
        return max(0, load_now + self.pending_by(t) - self.finishing(now, t))

    def observe(self, seconds: float) -> None:
        """Fold one observed decode time into the mean (the prior counts as one sample)."""
        if seconds > 0:
            self.observed += 1
            self.decode_s += (seconds - self.decode_s) / (self.observed + 1)


def decode_capacity(
    decode: DecodeCostModel, nodes: int, mean_context: float, tbt_slo_s: float
) -> int:
    """Requests the decode pool holds at ``mean_context`` tokens each, within its KV
    memory and with the step time within ``tbt_slo_s``."""
    if nodes <= 0:
        return 0
    ctx = max(mean_context, 1.0)
    by_memory = int(decode.kv_capacity_tokens // ctx)
    per = decode.per_request_s + decode.per_token_s * ctx
    by_tbt = int((tbt_slo_s - decode.base_s) / per) if per > 0 else by_memory
    return nodes * max(0, min(by_memory, by_tbt))


@dataclass
class AdmissionState:
    """The decode side's numbers an admission decision needs."""

    load_now: int  # requests decoding or waiting for decode now
    capacity: int  # requests the decode pool holds within SLO
    predicted_load: int | None = None  # at this request's predicted prefill end


def admit_decode(policy: str, state: AdmissionState, *, at_arrival: bool) -> str | None:
    """None to admit, or the reason to reject, for ``policy`` at this point.

    ``at_arrival``: the decision before prefill (``now``/``predicted``), or
    False for the decision after prefill (``after``).
    """
    policy = normalize_rejection(policy)
    if policy == "none":
        return None
    if at_arrival:
        if policy == "now" and state.load_now + 1 > state.capacity:
            return f"decode load {state.load_now} at capacity {state.capacity}"
        if policy == "predicted":
            load = state.predicted_load if state.predicted_load is not None else state.load_now
            if load + 1 > state.capacity:
                return f"predicted decode load {load} at capacity {state.capacity}"
        return None
    if policy == "after" and state.load_now + 1 > state.capacity:
        return f"decode pool full after prefill ({state.load_now}/{state.capacity})"
    return None


# -- the live router --------------------------------------------------------------------


@dataclass
class _Ewma:
    value: float
    alpha: float = 0.1

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


@dataclass
class ConductorRouter:
    """A ``kvpool.serve.sched.routing.Router`` over a ``Conductor`` (``--router conductor``).

    Per prefill worker the queue estimate is the cost model's time for its
    queued work (``queued_tokens`` as fresh tokens, ``c0`` per queued
    request), scaled by the observed/predicted ratio of finished prefills.
    Where the pool is reachable, ``pool.locate(keys)`` gives each node's
    prefix; a worker's node is ``reported["pool_node"]`` (or
    ``node_of[worker_id]``); a worker without a known node sees the whole
    pool's prefix (one shared pool on one machine). A fetch decision calls
    ``pool.replicate(keys[:blocks], node=...)``.

    Decode: the least-loaded decode worker; admission as in ``Rejection``
    (``after`` cannot be applied by the live front end before prefill, so
    it only applies the TTFT check here).

    Pipeline groups (``kvpool serve --cpp-group k``): when the best single
    worker's TTFT estimate misses the SLO or the tokens to compute reach
    ``cpp_min_tokens``, each ready group is estimated (its busiest member's
    queue + the plan's transfer + ``sim_cpp.pipeline_estimate`` with
    ``cpp_chunk``-token chunks) and the simulator's rule
    (``sim_cpp.choose_pipeline``) decides; the lowest qualifying group wins.
    ``cpp_min_tokens`` 0: never pipeline.
    """

    conductor: Conductor
    pool: Any = None
    rejection: str = "predicted"
    node_of: dict[str, str] = field(default_factory=dict)
    headroom: float = 0.9
    name: str = "conductor"
    correction: _Ewma = field(default_factory=lambda: _Ewma(1.0))
    decode_s: _Ewma = field(default_factory=lambda: _Ewma(5.0))
    mean_tokens: _Ewma = field(default_factory=lambda: _Ewma(1024.0))
    replicated: int = 0
    cpp_min_tokens: int = 0
    cpp_chunk: int = 512
    hop_bytes: int = 0  # bytes per token crossing a stage boundary (hidden x dtype)
    pipelined: int = 0

    def __post_init__(self) -> None:
        self.rejection = normalize_rejection(self.rejection)

    def _queue_s(self, w: Any) -> float:
        p = self.conductor.prefill
        work = p.c_token * w.queued_tokens + p.c0 * w.queued_requests
        work += p.c_pair * w.queued_tokens * w.queued_tokens / 2 / max(w.queued_requests, 1)
        return work * self.correction.value

    def _views(
        self, keys: list[bytes], prefill: list[Any]
    ) -> tuple[list[WorkerView], dict[str, int]]:
        by_node: dict[str, int] = {}
        if self.pool is not None and keys:
            try:
                by_node = prefix_by_node(self.pool.locate(keys))
            except Exception:
                by_node = {}
        shared = max(by_node.values(), default=0)
        views = []
        for w in prefill:
            node = w.reported.get("pool_node") or self.node_of.get(w.worker_id)
            local = by_node.get(node, 0) if node else shared
            views.append(WorkerView(w.worker_id, self._queue_s(w), local, node))
        return views, by_node

    def route(self, prompt_tokens: int, keys: list[bytes], workers: list[Any]) -> Any:
        from kvpool.serve.sched.routing import DECODE, PREFILL, RouteDecision

        prefill = [w for w in workers if w.kind == PREFILL and w.alive]
        decode = [w for w in workers if w.kind == DECODE and w.alive]
        if not prefill or not decode:
            return RouteDecision(reject="no live worker of each kind")
        views, by_node = self._views(keys, prefill)
        plan = self.conductor.choose(prompt_tokens, views, by_node)
        group, ttft = self._pipeline(prompt_tokens, plan, prefill)
        if self.rejection != "none" and ttft > self.conductor.ttft_slo(prompt_tokens):
            return RouteDecision(
                reject=f"TTFT SLO: predicted {ttft:.3f}s > "
                f"{self.conductor.ttft_slo(prompt_tokens):.3f}s"
            )
        load_now = sum(w.running + w.queued_requests for w in decode)
        capacity = 0
        for w in decode:
            if w.max_batch:
                capacity += w.max_batch
            elif w.kv_capacity_tokens:
                capacity += int(w.kv_capacity_tokens // max(self.mean_tokens.value, 1.0))
            else:
                capacity += 1 << 30
        capacity = int(capacity * self.headroom)
        in_prefill = sum(w.queued_requests + w.running for w in prefill)
        finishing = load_now * min(1.0, ttft / max(self.decode_s.value, 1e-9))
        predicted = round(load_now - finishing + in_prefill)
        reason = admit_decode(
            self.rejection,
            AdmissionState(load_now, capacity, predicted),
            at_arrival=True,
        )
        if reason:
            return RouteDecision(reject=reason)
        d = min(
            decode,
            key=lambda w: (w.running + w.queued_requests, w.queued_tokens, w.worker_id),
        )
        if plan.fetch_from is not None and plan.node and self.pool is not None:
            # best effort: a failed replication only costs the next request a fetch
            with contextlib.suppress(Exception):
                self.replicated += int(
                    self.pool.replicate(keys[: plan.reused_blocks], node=plan.node) or 0
                )
        if group is not None:
            self.pipelined += 1
            return RouteDecision(group=group, decode=d.worker_id)
        return RouteDecision(prefill=plan.worker_id, decode=d.worker_id)

    def _pipeline(
        self, prompt_tokens: int, plan: PrefillPlan, prefill: list[Any]
    ) -> tuple[str | None, float]:
        """(group, its TTFT estimate) when the request should be pipelined, else
        (None, the single worker's estimate)."""
        groups: dict[str, list[Any]] = {}
        for w in prefill:
            if getattr(w, "group", None):
                groups.setdefault(w.group, []).append(w)
        if not self.cpp_min_tokens or not groups:
            return None, plan.ttft_s
        from kvpool.serve.sched.sim.cpp import choose_pipeline, pipeline_estimate

        bt = self.conductor.block_tokens
        cached = min(plan.reused_blocks * bt, prompt_tokens - 1)
        new = prompt_tokens - cached
        slo = self.conductor.ttft_slo(prompt_tokens)
        if plan.ttft_s <= slo and new < self.cpp_min_tokens:
            return None, plan.ttft_s  # fits one worker: never split
        best: tuple[str | None, float] = (None, plan.ttft_s)
        for g, members in sorted(groups.items()):
            queues = [self._queue_s(m) for m in members]
            q = max(queues)
            pipe_s, _ = pipeline_estimate(
                self.conductor.prefill,
                self.conductor.transfer,
                self.hop_bytes,
                new,
                cached,
                len(members),
                self.cpp_chunk,
            )
            ttft = q + plan.transfer_s + pipe_s
            chosen = choose_pipeline(
                plan.ttft_s,
                ttft,
                slo,
                new,
                self.cpp_min_tokens,
                idle_s=sum(q - x for x in queues),
                work_s=len(members) * pipe_s,
            )
            if chosen and ttft < best[1]:
                best = (g, ttft)
        return best

    def observe(self, obs: Any) -> None:
        if obs.kind == "prefill" and obs.seconds > 0 and not obs.error:
            bt = self.conductor.block_tokens
            cached = (obs.cached_tokens // bt) * bt
            predicted = self.conductor.prefill.predict(obs.prompt_tokens - cached, cached)
            if predicted > 0:
                self.correction.update(obs.seconds / predicted)
            self.mean_tokens.update(float(obs.prompt_tokens))
        elif obs.kind == "request" and obs.tbt:
            self.decode_s.update(float(sum(obs.tbt)))


def default_prefill_model(model: Any) -> PrefillCostModel:
    """A CPU-class fallback when no calibration file is given: the preset's FLOPs at
    an assumed 20 GFLOP/s (tiny on one core), 2 ms overhead per request."""
    flops = 20e9
    return PrefillCostModel(
        c0=0.002,
        c_token=2 * model.matmul_params() / flops,
        c_pair=model.attention_flops_per_pair() / flops,
        model=model.name,
        source="default: preset FLOPs at 20 GFLOP/s",
    )


def conductor_from_context(ctx: Any) -> ConductorRouter:
    """Factory for ``routing.ROUTERS["conductor"]``.

    ``--router-opt`` keys: ``cost_model`` (a ``kvpool calibrate`` JSON),
    ``rejection`` (none|now|early|predicted), ``ttft_mult``, ``tbt_mult``,
    ``balance_threshold``, ``headroom`` (share of the decode capacity
    admitted, 0.9), ``nodes`` (``p0:NODE,p1:NODE``: the pool node next to
    each prefill worker, for per-node prefixes on a multi-node pool),
    ``bandwidth_gbps`` (pool transfer bandwidth, GB/s;
    default: the one in the cost model file, else 1.6, the design brief's
    2-process TCP get_into at 4 MiB).
    """
    opts = dict(ctx.options)
    cfg = ctx.model
    path = opts.get("cost_model")
    prefill = PrefillCostModel.load(path) if path else default_prefill_model(cfg)
    bandwidth = 1.6e9
    if path:  # the bandwidth kvpool calibrate measured, when the file has it
        with open(path, encoding="utf-8") as fh:
            bandwidth = float(json.load(fh).get("transfer", {}).get("bandwidth_Bps", bandwidth))
    if "bandwidth_gbps" in opts:
        bandwidth = float(opts["bandwidth_gbps"]) * 1e9
    conductor = Conductor(
        prefill,
        block_tokens=cfg.block_tokens,
        kv_bytes_per_token=cfg.kv_bytes_per_token,
        transfer=TransferModel(bandwidth, 200e-6),
        slo=SLO(float(opts.get("ttft_mult", 10.0)), float(opts.get("tbt_mult", 5.0))),
        balance_threshold=float(opts.get("balance_threshold", 0.8)),
    )
    pool = None
    if getattr(ctx, "pool_url", "") and str(ctx.pool_url).startswith("kvpool://"):
        try:
            import kvpool

            pool = kvpool.connect(ctx.pool_url)
        except Exception:
            pool = None
    node_of = {}
    for item in filter(None, opts.get("nodes", "").split(",")):
        worker, sep, node = item.partition(":")
        if not sep or not worker or not node:
            raise ValueError(f"router option nodes wants WORKER:NODE pairs, got {item!r}")
        node_of[worker.strip()] = node.strip()
    return ConductorRouter(
        conductor,
        pool=pool,
        rejection=opts.get("rejection", "predicted"),
        node_of=node_of,
        headroom=float(opts.get("headroom", 0.9)),
        cpp_min_tokens=int(getattr(ctx, "cpp_min_tokens", 0)),
        cpp_chunk=int(getattr(ctx, "chunk_tokens", 512)),
        hop_bytes=cfg.hidden_size * cfg.dtype_bytes,
    )
