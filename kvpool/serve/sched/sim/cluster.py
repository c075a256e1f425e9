"""The simulated cluster: the event loop over arrivals, prefills, KV transfers and decode.

Disaggregated mode (``--prefill P --decode D``): prefill nodes serve a FIFO
queue each; the KV then moves to the decode node with the most free KV
memory and joins its continuous batch, or waits for memory. Coupled mode
(``--coupled N``): a prefill runs between two decode steps of its node and
stalls the whole batch. See the package docstring for the models used.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from kvpool.eviction import make_policy
from kvpool.serve.sched.admission import (
    AdmissionState,
    DecodeLoadPredictor,
    admit_decode,
    decode_capacity,
    normalize_rejection,
)
from kvpool.serve.sched.conductor import ROUTE_FNS, Conductor, PrefillPlan, WorkerView
from kvpool.serve.sched.cost_model import ClusterCostModel, analytic_cluster, get_hardware
from kvpool.serve.sched.layerwise_model import remaining_transfer
from kvpool.serve.sched.sim.config import (
    ARRIVAL,
    DECODE_JOIN,
    PREFILL_DONE,
    WAKE,
    Node,
    Req,
    SimConfig,
)
from kvpool.serve.sched.sim.decode_engine import DecodeEngine
from kvpool.serve.sched.sim.load_series import LoadSampler
from kvpool.serve.sched.sim.summary import summarize


class Cluster:
    """The simulated cluster; ``run()`` returns the result dict."""

    def __init__(
        self,
        records: Sequence[Any],
        keys: Sequence[list[bytes]],
        config: SimConfig,
        cost: ClusterCostModel | None = None,
    ) -> None:
        config.validate()
        self.cfg = config
        self.cost = cost or analytic_cluster(
            config.model, get_hardware(config.hardware), block_tokens=config.block_tokens
        )
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
        self.sampler = LoadSampler(config.load_sample_s) if config.load_sample_s > 0 else None
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        # decode-side load
        self.decode_load = 0  # requests in transfer, waiting or decoding
        self.decode_tokens = 0.0  # their admission weights (KV tokens, Req.weight)
        self.mean_tokens = 0.0
        self.mean_output = 0.0
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

    def queue_seconds(self, node: Node, now: float) -> float:
        """Work committed to a prefill node at ``now``, in seconds."""
        if node.engine is not None:
            return max(0.0, node.engine.busy_until() - now)
        return max(0.0, node.busy_until - now)

    def _prefill_seconds(self, plan_transfer: float, plan_prefill: float) -> float:
        # issue 8: a cpp_group > 1 pipelines plan_prefill over the group's nodes
        return plan_transfer + plan_prefill

    def decode_capacity_tokens(self) -> float:
        """KV tokens the decode pool holds within its memory and the TBT SLO, at the
        mean request size, times the admission headroom."""
        mean_ctx = self.mean_tokens or 4096.0
        tbt = self.conductor.tbt_slo(int(mean_ctx))
        cap = decode_capacity(self.cost.decode, len(self.decode_nodes), mean_ctx, tbt)
        return cap * self.cfg.decode_headroom * mean_ctx

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
        r.compute_s = plan.prefill_s
        self.hit_blocks += plan.reused_blocks
        self.total_blocks += len(r.keys)
        if node.engine is not None:
            end = node.engine.add_stall(now, seconds)
            self._schedule_wake(idx)
        else:
            end = max(now, node.busy_until) + seconds
            node.busy_until = end
        self.predictor.add(rid, end, r.weight)
        self._push(end, PREFILL_DONE, rid)

    def _arrive(self, r: Req, now: float) -> list[WorkerView]:
        """Count the arrival, set its SLOs; the prefill nodes as the router sees them."""
        self.admitted_n += 1
        self.mean_tokens += (r.input + r.output - self.mean_tokens) / self.admitted_n
        self.mean_output += (r.output - self.mean_output) / self.admitted_n
        r.weight = r.input + self.mean_output  # its reply's length is not known yet
        r.ttft_slo = self.conductor.ttft_slo(r.input)
        r.tbt_slo = self.conductor.tbt_slo(r.input + r.output // 2)
        return [
            WorkerView(n.name, self.queue_seconds(n, now), self._local_blocks(n, r.keys), n.name)
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
                predicted = self.predictor.predict_peak(now, now + ttft_s, self.decode_tokens)
            cap = self.decode_capacity_tokens()
            state = AdmissionState(self.decode_tokens, cap, predicted, r.weight)
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
            cap = self.decode_capacity_tokens()
            state = AdmissionState(self.decode_tokens, cap, weight=r.weight)
            if admit_decode("after", state, at_arrival=False):
                r.rejected = "after-prefill"
                self.rejected_after += 1
                self.wasted_prefill_s += r.prefill_s
                self.predictor.remove(rid)
                return
        self.decode_load += 1
        self.decode_tokens += r.weight
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
        t = now + self.kv_after_prefill(r)
        r.ready = t
        self._push(t, DECODE_JOIN, rid)

    def kv_after_prefill(self, r: Req) -> float:
        """Seconds from the prefill's end until the KV is on the decode node: all of it
        unstreamed, else what layer-wise streaming leaves (``layerwise_model``)."""
        full = self.cost.kv_transfer_seconds(r.input)
        if not self.cfg.layerwise:
            return full
        layers = self.cost.config.num_layers
        return remaining_transfer(full, r.compute_s, layers, self.cfg.layer_overhead_s)

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
            self.decode_tokens -= r.weight
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
            if self.sampler is not None:
                self.sampler.sample_until(self, t)
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
        """The result dict ``kvpool sim`` prints (``sim.summary``)."""
        return summarize(self, wall_s)
