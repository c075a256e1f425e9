"""``--router conductor``: the live ``Router`` over a ``Conductor``.

The front end asks it per request (``route``) and tells it what was
measured (``observe``), so its queue estimates track this machine. The
routing rule is the conductor's (``kvpool.serve.sched.conductor``), the
admission rule ``kvpool.serve.sched.admission``'s and the pipeline rule
``kvpool.serve.sched.pipeline_model``'s: the simulator runs the same code.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.serve.sched.admission import (
    AdmissionState,
    LiveDecodeLedger,
    admit_decode,
    normalize_rejection,
)
from kvpool.serve.sched.conductor import SLO, Conductor, PrefillPlan, WorkerView, prefix_by_node
from kvpool.serve.sched.cost_model import PrefillCostModel, TransferModel
from kvpool.serve.sched.pipeline_model import choose_pipeline, pipeline_estimate
from kvpool.serve.sched.presets import ModelConfig
from kvpool.serve.sched.router_api import (
    NO_LIVE_WORKERS,
    Observation,
    RouteDecision,
    RouterContext,
    WorkerState,
    live_workers,
)

if TYPE_CHECKING:
    from kvpool.api import KVStore


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

    Decode: the least-loaded decode worker; admission as in ``kvpool.serve.sched.admission``
    (``after`` cannot be applied by the live front end before prefill, so
    it only applies the TTFT check here). The decode load is in KV tokens,
    as in the simulator: the decode workers' used KV (``kv_capacity_tokens -
    kv_free_tokens``) plus their queued tokens, against their KV capacity
    times ``headroom`` (workers that report no KV figures count requests at
    the mean request size). ``predicted`` asks the simulator's predictor
    (``LiveDecodeLedger`` over ``DecodeLoadPredictor.predict_peak``): the
    highest load over the interval this request would decode in, from the
    requests this router admitted that are still in prefill or decoding.

    Pipeline groups (``kvpool serve --cpp-group k``): when the best single
    worker's TTFT estimate misses the SLO or the tokens to compute reach
    ``cpp_min_tokens``, each ready group is estimated (its busiest member's
    queue + the plan's transfer + ``pipeline_model.pipeline_estimate`` with
    ``cpp_chunk``-token chunks) and the simulator's rule
    (``pipeline_model.choose_pipeline``) decides; the lowest qualifying group wins.
    ``cpp_min_tokens`` 0: never pipeline.
    """

    conductor: Conductor
    pool: KVStore | None = None
    rejection: str = "predicted"
    node_of: dict[str, str] = field(default_factory=dict)
    headroom: float = 0.9
    name: str = "conductor"
    correction: _Ewma = field(default_factory=lambda: _Ewma(1.0))
    mean_tokens: _Ewma = field(default_factory=lambda: _Ewma(1024.0))
    mean_output: _Ewma = field(default_factory=lambda: _Ewma(256.0))
    ledger: LiveDecodeLedger = field(default_factory=lambda: LiveDecodeLedger(5.0))
    clock: Callable[[], float] = time.monotonic
    replicated: int = 0
    cpp_min_tokens: int = 0
    cpp_chunk: int = 512
    hop_bytes: int = 0  # bytes per token crossing a stage boundary (hidden x dtype)
    pipelined: int = 0

    def __post_init__(self) -> None:
        self.rejection = normalize_rejection(self.rejection)

    def _queue_s(self, w: WorkerState) -> float:
        p = self.conductor.prefill
        work = p.c_token * w.queued_tokens + p.c0 * w.queued_requests
        work += p.c_pair * w.queued_tokens * w.queued_tokens / 2 / max(w.queued_requests, 1)
        return work * self.correction.value

    def _views(
        self, keys: list[bytes], prefill: list[WorkerState]
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

    def route(
        self, prompt_tokens: int, keys: list[bytes], workers: list[WorkerState]
    ) -> RouteDecision:
        prefill, decode = live_workers(workers)
        if not prefill or not decode:
            return NO_LIVE_WORKERS
        views, by_node = self._views(keys, prefill)
        plan = self.conductor.choose(prompt_tokens, views, by_node)
        group, ttft = self._pipeline(prompt_tokens, plan, prefill)
        if self.rejection != "none" and ttft > self.conductor.ttft_slo(prompt_tokens):
            return RouteDecision(
                reject=f"TTFT SLO: predicted {ttft:.3f}s > "
                f"{self.conductor.ttft_slo(prompt_tokens):.3f}s"
            )
        weight = prompt_tokens + self.mean_output.value  # KV tokens once it decodes
        load_now, capacity = self._decode_load(decode)
        now = self.clock()
        predicted = None
        if self.rejection == "predicted":
            predicted = self.ledger.predict_peak(now, now + ttft, load_now)
        reason = admit_decode(
            self.rejection,
            AdmissionState(load_now, capacity, predicted, weight),
            at_arrival=True,
        )
        if reason:
            return RouteDecision(reject=reason)
        self.ledger.admitted(now + ttft, weight)
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

    def _decode_load(self, decode: list[WorkerState]) -> tuple[float, float]:
        """(KV tokens held or queued on the decode workers, their capacity x headroom)."""
        size = self.mean_tokens.value + self.mean_output.value
        load = capacity = 0.0
        for w in decode:
            if w.kv_capacity_tokens and w.kv_free_tokens is not None:
                load += w.kv_capacity_tokens - w.kv_free_tokens + w.queued_tokens
            else:
                load += (w.running + w.queued_requests) * size
            if w.kv_capacity_tokens:
                capacity += w.kv_capacity_tokens
            elif w.max_batch:
                capacity += w.max_batch * size
            else:
                capacity = float("inf")
        return load, capacity * self.headroom

    def _pipeline(
        self, prompt_tokens: int, plan: PrefillPlan, prefill: list[WorkerState]
    ) -> tuple[str | None, float]:
        """(group, its TTFT estimate) when the request should be pipelined, else
        (None, the single worker's estimate)."""
        groups: dict[str, list[WorkerState]] = {}
        for w in prefill:
            if w.group:
                groups.setdefault(w.group, []).append(w)
        if not self.cpp_min_tokens or not groups:
            return None, plan.ttft_s
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

    def observe(self, obs: Observation) -> None:
        if obs.kind == "prefill":
            self.ledger.prefill_done(self.clock(), ok=not obs.error)
            if obs.seconds > 0 and not obs.error:
                bt = self.conductor.block_tokens
                cached = (obs.cached_tokens // bt) * bt
                predicted = self.conductor.prefill.predict(obs.prompt_tokens - cached, cached)
                if predicted > 0:
                    self.correction.update(obs.seconds / predicted)
                self.mean_tokens.update(float(obs.prompt_tokens))
        elif obs.kind == "request":
            ok = not obs.error
            self.ledger.finished(float(sum(obs.tbt)) if ok else 0.0, decoded=obs.ttft is not None)
            if obs.output_tokens and ok:
                self.mean_output.update(float(obs.output_tokens))


def default_prefill_model(model: ModelConfig) -> PrefillCostModel:
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


def conductor_from_context(ctx: RouterContext) -> ConductorRouter:
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
    pool: KVStore | None = None
    if ctx.pool_url.startswith("kvpool://"):
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
        cpp_min_tokens=ctx.cpp_min_tokens,
        cpp_chunk=ctx.chunk_tokens,
        hop_bytes=cfg.hidden_size * cfg.dtype_bytes,
    )
