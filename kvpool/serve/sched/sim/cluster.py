"""Discrete-event cluster simulator: the real conductor, index and eviction policies.

``kvpool sim TRACE --prefill 10 --decode 10`` serves a whole trace on a
simulated cluster of 8-GPU nodes (``cost_model.analytic_cluster``: the
llama2-70b shape on H100-class nodes; constants and sources there), with

- the real routing and admission code (``kvpool.serve.sched.conductor``: the
  conductor, the baseline routers, ``DecodeLoadPredictor``);
- the real index: every request's block keys are
  ``block_keys(tokens_for_request(record))`` (through
  ``kvpool.workload.cachesim.trace_keys``), so sharing is exactly what the
  pool would see — no stand-in for the hashing;
- the real eviction policies (``kvpool.eviction.make_policy``) for each
  node's share of the pool (``--capacity-blocks`` blocks per node), driven
  the way ``cachesim.simulate`` drives them.

Disaggregated mode (``--prefill P --decode D``): prefill nodes serve a FIFO
queue each (durations from the cost model, so the conductor's queue
estimate is the node's committed work); the first token leaves when the
prefill ends (TTFT); the KV then moves to the decode node with the most free
KV memory (transfer at the network bandwidth) and joins its continuous
batch, or waits for memory. Coupled mode (``--coupled N``): N nodes each run
prefill and decode; a prefill runs between two decode steps (prefill first,
as in vLLM's default scheduler), so it stalls the node's whole decode batch.

Decode batches are simulated per *epoch*, not per step: between two changes
of a batch (a join, a finish, a stall) the step time grows linearly with the
step index (``DecodeCostModel``: weights + every request's KV), so the time
of any step and the number of steps before a time are closed forms. Each
epoch is logged once; a request's inter-token gaps (and so its P90 TBT) are
read back from the log when it finishes. This is exact for the cost model and
keeps a 10,000-request trace well under a minute.

Issue 8 hook: ``SimConfig.cpp_group`` (pipeline prefill across k nodes)
changes only ``Cluster._prefill_seconds`` and the grouping of prefill nodes;
it is validated here and must be 1 until then.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpool.serve.sched.conductor import (
    REJECTIONS,
    ROUTE_FNS,
    SLO,
    AdmissionState,
    Conductor,
    DecodeLoadPredictor,
    PrefillPlan,
    WorkerView,
    admit_decode,
    decode_capacity,
    normalize_rejection,
)
from kvpool.serve.sched.cost_model import ClusterCostModel, DecodeCostModel, analytic_cluster

ARRIVAL, PREFILL_DONE, DECODE_JOIN, WAKE = 0, 1, 2, 3


@dataclass
class SimConfig:
    prefill: int = 10
    decode: int = 10
    coupled: int = 0  # > 0: N coupled nodes instead of P + D
    speed: float = 1.0  # arrival rate multiplier
    router: str = "conductor"
    rejection: str = "none"
    capacity_blocks: int = 8192  # per node (DRAM share of the pool), in blocks
    policy: str = "lru"
    slo: SLO = field(default_factory=SLO)
    balance_threshold: float = 0.8
    decode_headroom: float = 0.9  # admission aims at this share of the decode capacity
    seed: int = 0
    model: str = "llama2-70b"
    block_tokens: int = 512
    cpp_group: int = 1  # issue 8: pipeline prefill across k nodes

    def validate(self) -> None:
        if self.coupled < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("node counts must be >= 0")
        if self.coupled == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("need --prefill >= 1 and --decode >= 1 (or --coupled N)")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        if self.router not in ROUTE_FNS:
            raise ValueError(f"unknown router {self.router!r}; choose from {sorted(ROUTE_FNS)}")
        normalize_rejection(self.rejection)
        if self.capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        if not 0.0 < self.decode_headroom <= 1.0:
            raise ValueError("decode_headroom must be in (0, 1]")
        if self.cpp_group != 1:
            raise ValueError(
                "cpp_group > 1: use simulate() (kvpool.serve.sched.sim.cpp.CppCluster)"
            )


class DecodeEngine:
    """One node's continuous decode batch, simulated epoch by epoch.

    Step ``s`` (global index) takes ``a + b * (s - s0)`` seconds inside an
    epoch that starts at step ``s0``, where ``a`` is the step time at ``s0``
    and ``b = per_token_s * batch`` (every request's context grows one token
    per step). ``stall`` (coupled nodes) is time spent prefilling at the
    current step boundary before the next step runs.
    """

    def __init__(self, cost: DecodeCostModel) -> None:
        self.cost = cost
        self.capacity_tokens = cost.kv_capacity_tokens
        self.s = 0  # step index of the current boundary
        self.tb = 0.0  # time the boundary was reached (before the stall)
        self.stall = 0.0  # prefill time at this boundary before the next step
        self.batch = 0
        self.sum_base = 0  # sum over members of (context at join - join step)
        self.ends: list[tuple[int, int]] = []  # (end step, rid)
        self.version = 0
        self.reserved = 0  # KV tokens reserved by members (prompt + reply)
        self.waiting: deque[int] = deque()
        self.waiting_tokens = 0
        # epoch log
        self.seg_s: list[int] = []
        self.seg_e: list[int] = []
        self.seg_t0: list[float] = []
        self.seg_a: list[float] = []
        self.seg_b: list[float] = []
        self.stall_s: list[int] = []
        self.stall_t: list[float] = []

    # -- clock ------------------------------------------------------------------------

    def _a(self) -> float:
        c = self.cost
        return (
            c.base_s
            + c.per_request_s * self.batch
            + c.per_token_s * (self.sum_base + self.batch * self.s)
        )

    def busy_until(self) -> float:
        """When the node can next start a prefill (coupled) or the batch next changes."""
        return self.tb + self.stall

    def _advance(self, n: int) -> None:
        if n <= 0 or self.batch == 0:
            return
        a, b = self._a(), self.cost.per_token_s * self.batch
        t0 = self.tb + self.stall
        if self.stall > 0:
            self.stall_s.append(self.s)
            self.stall_t.append(self.stall)
        self.seg_s.append(self.s)
        self.seg_e.append(self.s + n)
        self.seg_t0.append(t0)
        self.seg_a.append(a)
        self.seg_b.append(b)
        self.tb = t0 + n * a + b * n * (n - 1) / 2
        self.s += n
        self.stall = 0.0

    def _steps_until(self, dt: float) -> int:
        """Smallest n with (time of n steps) >= dt."""
        if dt <= 0:
            return 0
        a, b = self._a(), self.cost.per_token_s * self.batch
        if b <= 0:
            n = math.ceil(dt / a)
        else:
            # b/2 n^2 + (a - b/2) n - dt = 0
            p = a - b / 2
            n = math.ceil((-p + math.sqrt(p * p + 2 * b * dt)) / b)
        n = max(n, 0)
        while n > 0 and (n - 1) * a + b * (n - 1) * (n - 2) / 2 >= dt:
            n -= 1
        while n * a + b * n * (n - 1) / 2 < dt:
            n += 1
        return n

    def sync(self, t: float) -> None:
        """Move the boundary to the first step boundary at or after ``t`` (no finishes)."""
        if self.batch == 0:
            if self.tb + self.stall <= t:
                if self.stall > 0:
                    self.stall_s.append(self.s)
                    self.stall_t.append(self.stall)
                self.tb, self.stall = t, 0.0
            return
        t0 = self.tb + self.stall
        if t <= t0:
            return
        n_max = self.ends[0][0] - self.s
        self._advance(min(self._steps_until(t - t0), n_max))

    def next_wake(self) -> float | None:
        if self.batch == 0:
            return None
        n = self.ends[0][0] - self.s
        a, b = self._a(), self.cost.per_token_s * self.batch
        return self.tb + self.stall + n * a + b * n * (n - 1) / 2

    # -- membership -------------------------------------------------------------------

    def join(self, rid: int, context: int, steps: int) -> int:
        """Add a request at the current boundary for ``steps`` steps; returns its join step."""
        j = self.s
        self.batch += 1
        self.sum_base += context - j
        heapq.heappush(self.ends, (j + steps, rid))
        return j

    def add_stall(self, t: float, seconds: float) -> float:
        """A prefill of ``seconds`` at the next boundary; returns when it ends."""
        self.sync(t)
        self.stall += seconds
        return self.tb + self.stall

    def finish_due(self) -> list[int]:
        """Advance to the earliest end and pop every request ending there."""
        n = self.ends[0][0] - self.s
        self._advance(n)
        done = []
        while self.ends and self.ends[0][0] == self.s:
            done.append(heapq.heappop(self.ends)[1])
        return done

    def leave(self, context_at_join: int, join_step: int) -> None:
        self.batch -= 1
        self.sum_base -= context_at_join - join_step

    # -- reading the log ----------------------------------------------------------------

    def _seg(self, step: int) -> int:
        return bisect.bisect_right(self.seg_s, step) - 1

    def step_time(self, step: int) -> tuple[float, float]:
        """(start time, duration) of a logged step."""
        i = self._seg(step)
        k = step - self.seg_s[i]
        a, b = self.seg_a[i], self.seg_b[i]
        return self.seg_t0[i] + k * a + b * k * (k - 1) / 2, a + b * k

    def gaps_over(self, join: int, end: int, first_token_t: float, slo: float) -> tuple[int, float]:
        """(gaps longer than ``slo``, the first gap) of a member over steps [join, end)."""
        start, d = self.step_time(join)
        first = start + d - first_token_t
        over = 1 if first > slo else 0
        lo = join + 1
        i = self._seg(lo) if lo < end else len(self.seg_s)
        while i < len(self.seg_s) and self.seg_s[i] < end:
            s0, s1 = max(lo, self.seg_s[i]), min(end, self.seg_e[i])
            if s1 > s0:
                a, b = self.seg_a[i], self.seg_b[i]
                if b <= 0:
                    k_star = 0 if a > slo else s1 - self.seg_s[i]
                else:
                    k_star = max(0, math.floor((slo - a) / b) + 1)
                over += max(0, s1 - max(s0, self.seg_s[i] + k_star))
            i += 1
        j = bisect.bisect_left(self.stall_s, lo)
        while j < len(self.stall_s) and self.stall_s[j] < end:
            _, d = self.step_time(self.stall_s[j])
            if d <= slo < d + self.stall_t[j]:
                over += 1
            j += 1
        return over, first


@dataclass
class Node:
    name: str
    cache: Any  # an EvictionPolicy
    busy_until: float = 0.0  # prefill FIFO (disaggregated prefill nodes)
    engine: DecodeEngine | None = None


@dataclass
class Req:
    arrival: float
    input: int
    output: int
    keys: list[bytes]
    ttft_slo: float = 0.0
    tbt_slo: float = 0.0
    prefill_node: int = -1
    decode_node: int = -1
    prefill_s: float = 0.0
    first_token: float = -1.0
    join_step: int = -1
    join_context: int = 0
    ready: float = 0.0  # KV arrived at the decode node
    end: float = -1.0
    rejected: str | None = None
    tbt_ok: bool = True
    mean_tbt: float = 0.0
    reused_blocks: int = 0


class Cluster:
    """The simulated cluster; ``run()`` returns the result dict."""

    def __init__(
        self,
        records: Sequence[Any],
        keys: Sequence[list[bytes]],
        config: SimConfig,
        cost: ClusterCostModel | None = None,
    ) -> None:
        from kvpool.eviction import make_policy

        config.validate()
        self.cfg = config
        self.cost = cost or analytic_cluster(config.model, block_tokens=config.block_tokens)
        cm = self.cost
        self.conductor = Conductor(
            cm.prefill,
            block_tokens=cm.config.block_tokens,
            kv_bytes_per_token=cm.config.kv_bytes_per_token,
            transfer=cm.transfer,
            decode=cm.decode,
            slo=config.slo,
            balance_threshold=config.balance_threshold,
        )
        self.route = ROUTE_FNS[config.router]
        self.rejection = normalize_rejection(config.rejection)
        self.rng = random.Random(config.seed)
        self.coupled = config.coupled > 0
        n_prefill = config.coupled if self.coupled else config.prefill
        self.prefill_nodes = [
            Node(f"{'c' if self.coupled else 'p'}{i}", make_policy(config.policy))
            for i in range(n_prefill)
        ]
        if self.coupled:
            for n in self.prefill_nodes:
                n.engine = DecodeEngine(cm.decode)
            self.decode_nodes = self.prefill_nodes
        else:
            self.decode_nodes = [
                Node(f"d{i}", make_policy("lru"), engine=DecodeEngine(cm.decode))
                for i in range(config.decode)
            ]
        t_first = records[0].timestamp if records else 0
        self.reqs = [
            Req(
                arrival=(r.timestamp - t_first) / 1000.0 / config.speed,
                input=r.input_length,
                output=r.output_length,
                keys=list(k),
            )
            for r, k in zip(records, keys, strict=True)
        ]
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        # decode-side load
        self.decode_load = 0  # requests in transfer, waiting or decoding
        self.mean_tokens = 0.0
        self.admitted_n = 0
        prior_decode = 256 * cm.decode.step_seconds(64, 64 * 4096)
        self.predictor = DecodeLoadPredictor(prior_decode)
        # stats
        self.hit_blocks = 0
        self.total_blocks = 0
        self.fetches = 0
        self.wasted_prefill_s = 0.0
        self.rejected_ttft = 0
        self.rejected_decode = 0
        self.rejected_after = 0

    # -- events ------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def _schedule_wake(self, node_idx: int) -> None:
        eng = self.decode_nodes[node_idx].engine
        assert eng is not None
        eng.version += 1
        t = eng.next_wake()
        if t is not None:
            self._push(t, WAKE, node_idx, eng.version)

    # -- prefill side --------------------------------------------------------------------

    def _local_blocks(self, node: Node, keys: list[bytes]) -> int:
        n = 0
        cache = node.cache
        for k in keys:
            if k not in cache:
                break
            n += 1
        return n

    def _queue_s(self, node: Node, now: float) -> float:
        if node.engine is not None:
            return max(0.0, node.engine.busy_until() - now)
        return max(0.0, node.busy_until - now)

    def _prefill_seconds(self, plan_transfer: float, plan_prefill: float) -> float:
        # issue 8: a cpp_group > 1 pipelines plan_prefill over the group's nodes
        return plan_transfer + plan_prefill

    def _capacity(self) -> int:
        mean_ctx = self.mean_tokens or 4096.0
        tbt = self.conductor.tbt_slo(int(mean_ctx))
        cap = decode_capacity(self.cost.decode, len(self.decode_nodes), mean_ctx, tbt)
        return int(cap * self.cfg.decode_headroom)

    def _on_arrival(self, rid: int, now: float) -> None:
        r = self.reqs[rid]
        views = self._arrive(r, now)
        plan = self.route(self.conductor, r.input, views, self.rng)
        if self._rejects(r, now, plan.ttft_s):
            return
        idx = next(i for i, n in enumerate(self.prefill_nodes) if n.name == plan.worker_id)
        node = self.prefill_nodes[idx]
        self._fetch(r, plan)
        seconds = self._prefill_seconds(plan.transfer_s, plan.prefill_s)
        r.prefill_node, r.prefill_s, r.reused_blocks = idx, seconds, plan.reused_blocks
        self.hit_blocks += plan.reused_blocks
        self.total_blocks += len(r.keys)
        if node.engine is not None:
            end = node.engine.add_stall(now, seconds)
            self._schedule_wake(idx)
        else:
            end = max(now, node.busy_until) + seconds
            node.busy_until = end
        self.predictor.add(rid, end)
        self._push(end, PREFILL_DONE, rid)

    def _arrive(self, r: Req, now: float) -> list[WorkerView]:
        """Count the arrival, set its SLOs; the prefill nodes as the router sees them."""
        self.admitted_n += 1
        self.mean_tokens += (r.input + r.output - self.mean_tokens) / self.admitted_n
        r.ttft_slo = self.conductor.ttft_slo(r.input)
        r.tbt_slo = self.conductor.tbt_slo(r.input + r.output // 2)
        return [
            WorkerView(n.name, self._queue_s(n, now), self._local_blocks(n, r.keys), n.name)
            for n in self.prefill_nodes
        ]

    def _rejects(self, r: Req, now: float, ttft_s: float) -> bool:
        """Apply the rejection policy to a request expected to start in ``ttft_s``."""
        if self.rejection != "none" and ttft_s > r.ttft_slo:
            r.rejected = "ttft"
            self.rejected_ttft += 1
            return True
        if self.rejection in ("now", "predicted"):
            predicted = None
            if self.rejection == "predicted":
                predicted = self.predictor.predict(now, now + ttft_s, self.decode_load)
            state = AdmissionState(self.decode_load, self._capacity(), predicted)
            if admit_decode(self.rejection, state, at_arrival=True):
                r.rejected = "decode"
                self.rejected_decode += 1
                return True
        return False

    def _fetch(self, r: Req, plan: PrefillPlan) -> None:
        """A plan that fetches a prefix from another node reads (touches) it there."""
        if plan.fetch_from is not None:
            src = next(n for n in self.prefill_nodes if n.name == plan.fetch_from)
            for k in r.keys[plan.local_blocks : plan.reused_blocks]:
                if k in src.cache:
                    src.cache.on_access(k)
            self.fetches += 1

    def _store(self, node: Node, keys: list[bytes]) -> None:
        cache, cap = node.cache, self.cfg.capacity_blocks
        parent: bytes | None = None
        for key in keys:
            if key in cache:
                cache.on_access(key)
            elif cap > 0 and cache.admit(key):
                n = len(cache)
                while n >= cap and cache.victim() is not None:
                    n -= 1
                if n < cap:
                    cache.on_insert(key, parent)
            parent = key

    def _on_prefill_done(self, rid: int, now: float) -> None:
        r = self.reqs[rid]
        node = self.prefill_nodes[r.prefill_node]
        self._store(node, r.keys)
        r.first_token = now
        if r.output <= 1:
            r.end = now
            self.predictor.remove(rid)
            return
        if self.rejection == "after":
            state = AdmissionState(self.decode_load, self._capacity())
            if admit_decode("after", state, at_arrival=False):
                r.rejected = "after-prefill"
                self.rejected_after += 1
                self.wasted_prefill_s += r.prefill_s
                self.predictor.remove(rid)
                return
        self.decode_load += 1
        if self.coupled:
            r.decode_node, r.ready = r.prefill_node, now
            self._decode_arrive(rid, now)
            return
        best = min(
            range(len(self.decode_nodes)),
            key=lambda i: (
                self.decode_nodes[i].engine.reserved + self.decode_nodes[i].engine.waiting_tokens,  # type: ignore[union-attr]
                i,
            ),
        )
        r.decode_node = best
        t = now + self.cost.kv_transfer_seconds(r.input)
        r.ready = t
        self._push(t, DECODE_JOIN, rid)

    # -- decode side ----------------------------------------------------------------------

    def _decode_arrive(self, rid: int, now: float) -> None:
        r = self.reqs[rid]
        eng = self.decode_nodes[r.decode_node].engine
        assert eng is not None
        eng.sync(now)
        need = r.input + r.output
        if eng.waiting or (eng.reserved + need > eng.capacity_tokens and eng.batch > 0):
            eng.waiting.append(rid)
            eng.waiting_tokens += need
            return
        self._join(rid, eng)
        self._schedule_wake(r.decode_node)

    def _join(self, rid: int, eng: DecodeEngine) -> None:
        r = self.reqs[rid]
        eng.reserved += r.input + r.output
        r.join_context = r.input
        r.join_step = eng.join(rid, r.input, r.output - 1)
        self.predictor.start(rid, max(eng.busy_until(), r.ready))

    def _on_wake(self, idx: int, version: int, now: float) -> None:
        eng = self.decode_nodes[idx].engine
        assert eng is not None
        if version != eng.version or eng.batch == 0:
            return
        done = eng.finish_due()
        for rid in done:
            r = self.reqs[rid]
            eng.leave(r.join_context, r.join_step)
            eng.reserved -= r.input + r.output
            r.end = eng.tb
            n_gaps = r.output - 1
            over, _first = eng.gaps_over(
                r.join_step, r.join_step + n_gaps, r.first_token, r.tbt_slo
            )
            r.mean_tbt = (r.end - r.first_token) / n_gaps
            # P90 of the gaps within the SLO, and the mean gap too: a P90 alone
            # ignores one long wait for decode memory after the first token
            r.tbt_ok = (
                over <= n_gaps - math.ceil(self.cfg.slo.percentile / 100.0 * n_gaps)
                and r.mean_tbt <= r.tbt_slo
            )
            self.decode_load -= 1
            self.predictor.remove(rid)
            self.predictor.observe(r.end - r.first_token)
        while eng.waiting:
            rid = eng.waiting[0]
            need = self.reqs[rid].input + self.reqs[rid].output
            if eng.batch > 0 and eng.reserved + need > eng.capacity_tokens:
                break
            eng.waiting.popleft()
            eng.waiting_tokens -= need
            self._join(rid, eng)
        self._schedule_wake(idx)

    # -- run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        for rid, r in enumerate(self.reqs):
            self._push(r.arrival, ARRIVAL, rid)
        events = self.events
        while events:
            t, _seq, kind, a, b = heapq.heappop(events)
            if kind == ARRIVAL:
                self._on_arrival(a, t)
            elif kind == PREFILL_DONE:
                self._on_prefill_done(a, t)
            elif kind == DECODE_JOIN:
                self._decode_arrive(a, t)
            else:
                self._on_wake(a, b, t)
        return self.results(time.perf_counter() - t0)

    def results(self, wall_s: float = 0.0) -> dict[str, Any]:
        reqs = self.reqs
        n = len(reqs)
        done = [r for r in reqs if r.rejected is None and r.end >= 0]
        ttft = [r.first_token - r.arrival for r in done]
        ttft_ok = [r.first_token - r.arrival <= r.ttft_slo for r in done]
        tbt_ok = [r.tbt_ok for r in done]
        good = sum(1 for r, a in zip(done, ttft_ok, strict=True) if a and r.tbt_ok)
        span = (reqs[-1].arrival - reqs[0].arrival) if n > 1 else 0.0
        ttft_sorted = sorted(ttft)

        def pct(xs: list[float], p: float) -> float:
            if not xs:
                return 0.0
            return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]

        tbts = sorted(r.mean_tbt for r in done if r.output > 1)
        cfg = self.cfg
        return {
            "requests": n,
            "completed": len(done),
            "rejected": sum(1 for r in reqs if r.rejected is not None),
            "ttft_slo_attainment": sum(ttft_ok) / len(done) if done else 0.0,
            "tbt_slo_attainment": sum(tbt_ok) / len(done) if done else 0.0,
            "goodput_rps": good / span if span > 0 else float(good),
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else 0.0,
            "hit_ratio": self.hit_blocks / self.total_blocks if self.total_blocks else 0.0,
            "good": good,
            "slo_attainment_all": good / n if n else 0.0,
            "p90_ttft_s": pct(ttft_sorted, 90),
            "p99_ttft_s": pct(ttft_sorted, 99),
            "mean_tbt_s": sum(tbts) / len(tbts) if tbts else 0.0,
            "p99_mean_tbt_s": pct(tbts, 99),
            "rejected_ttft": self.rejected_ttft,
            "rejected_decode": self.rejected_decode,
            "rejected_after_prefill": self.rejected_after,
            "wasted_prefill_s": self.wasted_prefill_s,
            "fetches": self.fetches,
            "duration_s": span,
            "makespan_s": max((r.end for r in done), default=0.0),
            "sim_wall_s": wall_s,
            "config": {
                "prefill": 0 if self.coupled else cfg.prefill,
                "decode": 0 if self.coupled else cfg.decode,
                "coupled": cfg.coupled,
                "speed": cfg.speed,
                "router": cfg.router,
                "rejection": cfg.rejection,
                "capacity_blocks": cfg.capacity_blocks,
                "policy": cfg.policy,
                "slo": asdict(cfg.slo),
                "balance_threshold": cfg.balance_threshold,
                "decode_headroom": cfg.decode_headroom,
                "model": cfg.model,
                "cpp_group": cfg.cpp_group,
            },
        }


def simulate(
    records: Sequence[Any],
    config: SimConfig | None = None,
    *,
    keys: Sequence[list[bytes]] | None = None,
    cost: ClusterCostModel | None = None,
) -> dict[str, Any]:
    """Simulate ``records`` (``TraceRecord``s) on the configured cluster; the result dict."""
    from kvpool.workload.cachesim import trace_keys

    cfg = config or SimConfig()
    if keys is None:
        keys = trace_keys(records, cfg.block_tokens)
    if cfg.cpp_group != 1:  # issue 8: pipeline prefill groups (kvpool.serve.sched.sim.cpp)
        from kvpool.serve.sched.sim.cpp import CppCluster

        return CppCluster(records, keys, cfg, cost).run()
    return Cluster(records, keys, cfg, cost).run()


# -- CLI ------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="simulate a cluster serving a trace (conductor, routers, rejection policies)",
        description="Discrete-event simulation of a llama2-70b cluster of 8-GPU nodes serving "
        "a JSON-lines trace with the real conductor, index and eviction policies.",
    )
    p.add_argument("trace", help="JSON-lines trace (kvpool trace synth)")
    p.add_argument("--prefill", type=int, default=10, help="prefill nodes")
    p.add_argument("--decode", type=int, default=10, help="decode nodes")
    p.add_argument("--coupled", type=int, default=0, help="N coupled prefill+decode nodes instead")
    p.add_argument("--speed", type=float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--router", choices=sorted(ROUTE_FNS), default="conductor")
    p.add_argument(
        "--rejection",
        choices=REJECTIONS,
        default="none",
        help="none | now (= early: on the decode load now) | after (only after prefill) "
        "| predicted (decode load predicted at prefill end)",
    )
    p.add_argument("--capacity-blocks", type=int, default=8192, help="pool blocks per node")
    p.add_argument("--policy", default="lru", help="eviction policy (kvpool.eviction names)")
    p.add_argument("--ttft-slo", type=float, default=10.0, help="x unloaded TTFT (P90)")
    p.add_argument("--tbt-slo", type=float, default=5.0, help="x unloaded TBT (P90)")
    p.add_argument("--balance-threshold", type=float, default=0.8)
    p.add_argument(
        "--decode-headroom",
        type=float,
        default=0.9,
        help="admission targets this share of the decode pool's capacity",
    )
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--limit", type=int, default=0, help="first N requests only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpp-group", type=int, default=1, help="pipeline prefill over k nodes")
    p.add_argument("--json", default=None, help="write the result object here")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:

    from kvpool.workload.traces import load_for_command

    records = load_for_command(args.trace, "sim", block_tokens=args.block_tokens, limit=args.limit)
    if records is None:
        return 2
    cfg = SimConfig(
        prefill=args.prefill,
        decode=args.decode,
        coupled=args.coupled,
        speed=args.speed,
        router=args.router,
        rejection=args.rejection,
        capacity_blocks=args.capacity_blocks,
        policy=args.policy,
        slo=SLO(args.ttft_slo, args.tbt_slo),
        balance_threshold=args.balance_threshold,
        decode_headroom=args.decode_headroom,
        seed=args.seed,
        model=args.model,
        block_tokens=args.block_tokens,
        cpp_group=args.cpp_group,
    )
    try:
        result = simulate(records, cfg)
    except ValueError as exc:
        print(f"kvpool sim: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0
