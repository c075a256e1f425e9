"""``kvpool plan TRACE --nodes N``: capacity planning with the cluster simulator.

For a fixed cluster of N nodes (llama2-70b on 8 x H100 each, the
simulator's ``cost_model.analytic_cluster``):

1. **split**: every prefill/decode split (P prefill + N-P decode nodes) and
   every pipeline group size in ``--cpp-groups`` that divides P is simulated
   (``kvpool.serve.sched.sim.runner.simulate`` / ``sim.cpp.CppCluster``: the real
   conductor, index and eviction policies); the curve is goodput (requests
   per second meeting both the TTFT and the TBT SLO) against P, each P at
   its best group size. Each point also carries its *sustainable rate*
   (``sim.rate``, DistServe's goodput: the highest request rate, found by
   searching the speed, at which ``--attainment`` of the requests meet both
   SLOs) and that rate per node; the best split maximises the sustainable
   rate (then goodput at ``--speed``);
2. **coupled baseline**: the same N nodes each running prefill and decode,
   its goodput at ``--speed`` and its sustainable rate the same way;
3. **smallest cluster** (``--target-speed``, default ``--speed``): the
   fewest nodes whose best split serves the trace, at that arrival-rate
   multiplier, with at least ``--attainment`` of all requests within both
   SLOs (binary search on N; per N a coarse split scan refined by hill
   climbing);
4. **pool sizing**: for each eviction policy in ``--policies`` (the real
   ``kvpool.eviction`` policies, replayed request by request through
   ``eviction.cachesim.simulate``), the prefix-hit ratio and the prefill
   compute it saves (cost model: seconds of the whole prompt minus seconds
   of the uncached rest after the cached prefix) against DRAM and SSD
   capacity in blocks. DRAM + SSD is modelled as one cache of the summed
   capacity (blocks demote to SSD on DRAM eviction and promote back on a
   hit, so together they hold what one policy of that size would); the
   DRAM share of the hits is the same policy at the DRAM capacity.

Output: a report on stdout, ``--json F`` (keys ``best`` {prefill, decode,
cpp_group, goodput_rps, sustainable_rps, sustainable_rps_per_node}, ``curve``
[{prefill, decode, cpp_group, goodput_rps, ttft_slo_attainment,
tbt_slo_attainment, sustainable_rps, sustainable_speed, ...}],
``coupled_goodput_rps``, ``coupled_sustainable_rps``, ``smallest_cluster``,
``pool_sizing``, ``config``)
and a PNG of the curve (``--plot F``; needs matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvpool.eviction import make_policy
from kvpool.serve.sched.cost_model import ClusterCostModel
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.rate import RateSearch, find_rate, trace_rate
from kvpool.serve.sched.sim.runner import simulate
from kvpool.workload.cachesim import simulate as cache_replay
from kvpool.workload.cachesim import trace_keys

CURVE_KEYS = ("prefill", "decode", "cpp_group", "goodput_rps")
RATE_KEYS = ("sustainable_rps", "sustainable_rps_per_node")


class Planner:
    """Runs simulations of one trace under one base configuration."""

    def __init__(
        self,
        records: Sequence[Any],
        base: SimConfig,
        cpp_groups: Sequence[int],
        search: RateSearch | None = None,
    ) -> None:
        self.records = list(records)
        self.base = base
        self.cpp_groups = sorted(set(cpp_groups)) or [1]
        self.keys = trace_keys(self.records, base.block_tokens)
        self.search = search or RateSearch()
        self.runs = 0

    def run(self, **changes: Any) -> dict[str, Any]:
        self.runs += 1
        return simulate(self.records, replace(self.base, **changes), keys=self.keys)

    def sustainable(self, start: float, **changes: Any) -> dict[str, Any]:
        """The sustainable rate of the configuration ``changes`` (``sim.rate.find_rate``)."""
        rate = find_rate(
            lambda s: self.run(**changes, speed=s), trace_rate(self.records), start, self.search
        )
        return {k: rate[k] for k in ("sustainable_rps", "sustainable_speed")}

    def split_point(
        self, nodes: int, prefill: int, speed: float, *, rate_from: float | None = None
    ) -> dict[str, Any]:
        """Prefill nodes ``prefill`` of ``nodes``, at the best group size; with
        ``rate_from`` (the speed to start the search at), also its sustainable rate."""
        best: dict[str, Any] | None = None
        for g in self.cpp_groups:
            if prefill % g:
                continue
            split = {"prefill": prefill, "decode": nodes - prefill, "cpp_group": g}
            res = self.run(**split, speed=speed)
            point = {
                **split,
                "goodput_rps": res["goodput_rps"],
                "ttft_slo_attainment": res["ttft_slo_attainment"],
                "tbt_slo_attainment": res["tbt_slo_attainment"],
                "slo_attainment_all": res["slo_attainment_all"],
                "p90_ttft_s": res["p90_ttft_s"],
            }
            if rate_from is not None:
                point.update(self.sustainable(rate_from, **split))
                point["sustainable_rps_per_node"] = point["sustainable_rps"] / nodes
            if best is None or _better(point, best):
                best = point
        assert best is not None
        return best

    def curve(self, nodes: int, speed: float) -> list[dict[str, Any]]:
        """Every split with its sustainable rate (each search starts where the last ended)."""
        out: list[dict[str, Any]] = []
        start = speed
        for p in range(1, nodes):
            point = self.split_point(nodes, p, speed, rate_from=start)
            start = point["sustainable_speed"] or speed
            out.append(point)
        return out

    def best_split(self, nodes: int, speed: float) -> dict[str, Any]:
        """Coarse scan of P, then hill climbing by +-1 (goodput is unimodal enough in P)."""
        if nodes < 2:
            raise ValueError("a disaggregated cluster needs at least 2 nodes")
        seen: dict[int, dict[str, Any]] = {}

        def at(p: int) -> dict[str, Any]:
            if p not in seen:
                seen[p] = self.split_point(nodes, p, speed)
            return seen[p]

        coarse = sorted({min(nodes - 1, max(1, round(f * nodes))) for f in (0.2, 0.4, 0.6, 0.8)})
        best = max((at(p) for p in coarse), key=rank_key)
        while True:
            p = best["prefill"]
            nxt = [at(q) for q in (p - 1, p + 1) if 1 <= q < nodes]
            cand = max([best, *nxt], key=rank_key)
            if cand is best:
                return best
            best = cand

    def smallest_cluster(
        self, speed: float, attainment: float, max_nodes: int
    ) -> dict[str, Any] | None:
        """Fewest nodes whose best split keeps ``attainment`` of requests within SLO."""

        def ok(n: int) -> dict[str, Any] | None:
            point = self.best_split(n, speed)
            return point if point["slo_attainment_all"] >= attainment else None

        hi = 2
        found = ok(hi)
        while found is None:
            if hi >= max_nodes:
                return None
            hi = min(max_nodes, hi * 2)
            found = ok(hi)
        lo = hi // 2 + 1 if hi > 2 else 2  # hi // 2 failed (or hi is the first probe)
        best_n, best_point = hi, found
        while lo < best_n:
            mid = (lo + best_n) // 2
            point = ok(mid)
            if point is None:
                lo = mid + 1
            else:
                best_n, best_point = mid, point
        return {"nodes": best_n, "speed": speed, "attainment": attainment, **best_point}


def rank_key(p: dict[str, Any]) -> tuple[float, float, float]:
    """Sustainable rate first (where searched), then goodput at the speed, then attainment."""
    return (p.get("sustainable_rps", 0.0), p["goodput_rps"], p["slo_attainment_all"])


def _better(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return rank_key(a) > rank_key(b)


# -- pool sizing ----------------------------------------------------------------------------


def pool_sizing(
    records: Sequence[Any],
    keys: Sequence[list[bytes]],
    cost: ClusterCostModel,
    policies: Sequence[str],
    dram_blocks: Sequence[int],
    ssd_blocks: Sequence[int],
) -> list[dict[str, Any]]:
    """Hit ratio and saved prefill compute per policy, DRAM and SSD capacity (blocks)."""
    bt = cost.config.block_tokens
    predict = cost.prefill.predict
    full = sum(predict(r.input_length, 0) for r in records)

    def replay(policy: str, capacity: int) -> tuple[float, float]:
        cache = make_policy(policy)
        hits = total = 0
        saved = 0.0
        for rec, ks in zip(records, keys, strict=True):
            h, t = cache_replay([ks], cache, capacity)  # state carries over between calls
            hits, total = hits + h, total + t
            cached = min(h * bt, rec.input_length - 1)
            saved += predict(rec.input_length, 0) - predict(rec.input_length - cached, cached)
        return (hits / total if total else 0.0), (saved / full if full else 0.0)

    rows: list[dict[str, Any]] = []
    block_gib = cost.block_bytes / 2**30
    for policy in policies:
        dram_only = {d: replay(policy, d) for d in dram_blocks}
        for d in dram_blocks:
            for s in ssd_blocks:
                hit, saved = dram_only[d] if s == 0 else replay(policy, d + s)
                rows.append(
                    {
                        "policy": policy,
                        "dram_blocks": d,
                        "ssd_blocks": s,
                        "dram_gib": d * block_gib,
                        "ssd_gib": s * block_gib,
                        "hit_ratio": hit,
                        "dram_hit_ratio": dram_only[d][0],
                        "saved_prefill_fraction": saved,
                        "saved_prefill_s": saved * full,
                    }
                )
    return rows
