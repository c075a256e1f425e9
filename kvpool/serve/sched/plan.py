"""``kvpool plan TRACE --nodes N``: capacity planning with the cluster simulator.

For a fixed cluster of N nodes (llama2-70b on 8 x H100 each, the
simulator's ``cost_model.analytic_cluster``):

1. **split**: every prefill/decode split (P prefill + N-P decode nodes) and
   every pipeline group size in ``--cpp-groups`` that divides P is simulated
   (``kvpool.serve.sched.sim.runner.simulate`` / ``sim.cpp.CppCluster``: the real
   conductor, index and eviction policies); the curve is goodput (requests
   per second meeting both the TTFT and the TBT SLO) against P, each P at
   its best group size; the best split maximises goodput;
2. **coupled baseline**: the same N nodes each running prefill and decode;
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
cpp_group, goodput_rps}, ``curve`` [{prefill, decode, cpp_group,
goodput_rps, ttft_slo_attainment, tbt_slo_attainment}],
``coupled_goodput_rps``, ``smallest_cluster``, ``pool_sizing``, ``config``)
and a PNG of the curve (``--plot F``; needs matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvpool.serve.sched.conductor import SLO
from kvpool.serve.sched.cost_model import ClusterCostModel, analytic_cluster
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.runner import simulate

CURVE_KEYS = ("prefill", "decode", "cpp_group", "goodput_rps")


class Planner:
    """Runs simulations of one trace under one base configuration."""

    def __init__(self, records: Sequence[Any], base: SimConfig, cpp_groups: Sequence[int]) -> None:
        from kvpool.workload.cachesim import trace_keys

        self.records = list(records)
        self.base = base
        self.cpp_groups = sorted(set(cpp_groups)) or [1]
        self.keys = trace_keys(self.records, base.block_tokens)
        self.runs = 0

    def run(self, **changes: Any) -> dict[str, Any]:
        self.runs += 1
        return simulate(self.records, replace(self.base, **changes), keys=self.keys)

    def split_point(self, nodes: int, prefill: int, speed: float) -> dict[str, Any]:
        """Prefill nodes ``prefill`` of ``nodes``, at the best group size."""
        best: dict[str, Any] | None = None
        for g in self.cpp_groups:
            if prefill % g:
                continue
            res = self.run(prefill=prefill, decode=nodes - prefill, cpp_group=g, speed=speed)
            point = {
                "prefill": prefill,
                "decode": nodes - prefill,
                "cpp_group": g,
                "goodput_rps": res["goodput_rps"],
                "ttft_slo_attainment": res["ttft_slo_attainment"],
                "tbt_slo_attainment": res["tbt_slo_attainment"],
                "slo_attainment_all": res["slo_attainment_all"],
                "p90_ttft_s": res["p90_ttft_s"],
            }
            if best is None or _better(point, best):
                best = point
        assert best is not None
        return best

    def curve(self, nodes: int, speed: float) -> list[dict[str, Any]]:
        return [self.split_point(nodes, p, speed) for p in range(1, nodes)]

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
        best = max((at(p) for p in coarse), key=_key)
        while True:
            p = best["prefill"]
            nxt = [at(q) for q in (p - 1, p + 1) if 1 <= q < nodes]
            cand = max([best, *nxt], key=_key)
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


def _key(p: dict[str, Any]) -> tuple[float, float]:
    return (p["goodput_rps"], p["slo_attainment_all"])


def _better(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _key(a) > _key(b)


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
    from kvpool.eviction import make_policy
    from kvpool.workload.cachesim import simulate as cache_replay

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


# -- report ---------------------------------------------------------------------------------


def format_report(out: dict[str, Any]) -> str:
    lines = []
    cfg = out["config"]
    b = out["best"]
    lines.append(
        f"trace {cfg['trace']}: {cfg['requests']} requests, speed x{cfg['speed']}, "
        f"SLO TTFT {cfg['slo_ttft']}x / TBT {cfg['slo_tbt']}x unloaded, {cfg['nodes']} nodes"
    )
    lines.append(
        f"best split: {b['prefill']} prefill + {b['decode']} decode (cpp group {b['cpp_group']}): "
        f"{b['goodput_rps']:.2f} req/s within SLO"
    )
    lines.append(
        f"coupled baseline ({cfg['nodes']} nodes): {out['coupled_goodput_rps']:.2f} req/s "
        f"(best split / coupled = {_ratio(b['goodput_rps'], out['coupled_goodput_rps'])})"
    )
    lines.append("")
    lines.append("| prefill | decode | cpp group | goodput req/s | TTFT SLO met | TBT SLO met |")
    lines.append("|---|---|---|---|---|---|")
    for p in out["curve"]:
        lines.append(
            f"| {p['prefill']} | {p['decode']} | {p['cpp_group']} | {p['goodput_rps']:.2f} | "
            f"{p['ttft_slo_attainment']:.3f} | {p['tbt_slo_attainment']:.3f} |"
        )
    sc = out.get("smallest_cluster")
    lines.append("")
    if sc is None:
        lines.append("smallest cluster: none within the searched sizes")
    else:
        lines.append(
            f"smallest cluster within SLO at speed x{sc['speed']} "
            f"(>= {sc['attainment']:.0%} of requests within both SLOs): {sc['nodes']} nodes = "
            f"{sc['prefill']} prefill + {sc['decode']} decode (cpp group {sc['cpp_group']}), "
            f"{sc['slo_attainment_all']:.3f} within SLO, {sc['goodput_rps']:.2f} req/s"
        )
    if out.get("pool_sizing"):
        lines.append("")
        lines.append(
            "| policy | DRAM blocks (GiB) | SSD blocks (GiB) | hit ratio | from DRAM | "
            "prefill compute saved |"
        )
        lines.append("|---|---|---|---|---|---|")
        for r in out["pool_sizing"]:
            lines.append(
                f"| {r['policy']} | {r['dram_blocks']:,} ({r['dram_gib']:,.0f}) | "
                f"{r['ssd_blocks']:,} ({r['ssd_gib']:,.0f}) | {r['hit_ratio']:.3f} | "
                f"{r['dram_hit_ratio']:.3f} | {r['saved_prefill_fraction']:.1%} |"
            )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def plot_curve(out: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'kvpool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["prefill"] for p in out["curve"]]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(xs, [p["goodput_rps"] for p in out["curve"]], marker="o", label="disaggregated")
    ax.axhline(out["coupled_goodput_rps"], color="gray", linestyle="--", label="coupled")
    b = out["best"]
    ax.scatter([b["prefill"]], [b["goodput_rps"]], color="red", zorder=3, label="best")
    ax.set_xlabel(f"prefill nodes (of {out['config']['nodes']})")
    ax.set_ylabel("goodput (req/s within SLO)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- CLI ------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="capacity planner: prefill/decode split, smallest cluster, pool sizing",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("trace", help="JSON-lines trace")
    p.add_argument("--nodes", type=int, default=20, help="cluster size to split")
    p.add_argument("--slo-ttft", type=float, default=10.0, help="x unloaded TTFT (P90)")
    p.add_argument("--slo-tbt", type=float, default=5.0, help="x unloaded TBT (P90)")
    p.add_argument("--speed", type=float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--cpp-groups", default="1,2", help="pipeline group sizes to try")
    p.add_argument("--router", default="conductor")
    p.add_argument("--rejection", default="none")
    p.add_argument("--capacity-blocks", type=int, default=8192, help="pool blocks per node")
    p.add_argument("--policy", default="lru", help="eviction policy in the cluster simulation")
    p.add_argument("--limit", type=int, default=0, help="first N requests only")
    p.add_argument("--target-speed", type=float, default=None, help="for the smallest cluster")
    p.add_argument("--attainment", type=float, default=0.9, help="share within both SLOs")
    p.add_argument("--max-nodes", type=int, default=128)
    p.add_argument("--policies", default="lru,s3fifo,leaf-s3", help="pool sizing policies")
    p.add_argument("--dram-blocks", default=None, help="comma list (default: from the trace)")
    p.add_argument("--ssd-blocks", default=None, help="comma list (default: from the trace)")
    p.add_argument("--no-pool-sizing", action="store_true")
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--json", default=None, metavar="F")
    p.add_argument("--plot", default=None, metavar="F.png", help="default: next to --json")
    p.set_defaults(func=_run_cli)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def plan(args: argparse.Namespace, records: Sequence[Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = SimConfig(
        speed=args.speed,
        router=args.router,
        rejection=args.rejection,
        capacity_blocks=args.capacity_blocks,
        policy=args.policy,
        slo=SLO(args.slo_ttft, args.slo_tbt),
        model=args.model,
        block_tokens=args.block_tokens,
    )
    planner = Planner(records, base, _ints(args.cpp_groups))
    if args.nodes < 2:
        raise ValueError("--nodes must be >= 2")
    curve = planner.curve(args.nodes, args.speed)
    best = max(curve, key=_key)
    coupled = planner.run(coupled=args.nodes, prefill=0, decode=0, speed=args.speed)
    target = args.speed if args.target_speed is None else args.target_speed
    smallest = planner.smallest_cluster(target, args.attainment, args.max_nodes)
    sizing: list[dict[str, Any]] = []
    if not args.no_pool_sizing:
        unique = len({k for ks in planner.keys for k in ks})
        dram = _ints(args.dram_blocks) if args.dram_blocks else _fractions(unique, (32, 8, 2))
        ssd = _ints(args.ssd_blocks) if args.ssd_blocks else [0, *_fractions(unique, (4, 1))]
        cost = analytic_cluster(args.model, block_tokens=args.block_tokens)
        policies = [p for p in args.policies.split(",") if p.strip()]
        sizing = pool_sizing(planner.records, planner.keys, cost, policies, dram, ssd)
    return {
        "best": {k: best[k] for k in CURVE_KEYS},
        "curve": curve,
        "coupled_goodput_rps": coupled["goodput_rps"],
        "coupled": {
            k: coupled[k] for k in ("goodput_rps", "ttft_slo_attainment", "tbt_slo_attainment")
        },
        "smallest_cluster": smallest,
        "pool_sizing": sizing,
        "config": {
            "trace": args.trace,
            "requests": len(planner.records),
            "nodes": args.nodes,
            "speed": args.speed,
            "slo_ttft": args.slo_ttft,
            "slo_tbt": args.slo_tbt,
            "cpp_groups": planner.cpp_groups,
            "router": args.router,
            "model": args.model,
            "simulations": planner.runs,
            "wall_s": time.perf_counter() - t0,
        },
    }


def _fractions(unique: int, divisors: Sequence[int]) -> list[int]:
    return sorted({max(1, unique // d) for d in divisors})


def _run_cli(args: argparse.Namespace) -> int:

    from kvpool.workload.traces import load_for_command

    records = load_for_command(
        args.trace, "plan", block_tokens=args.block_tokens, limit=args.limit, allow_empty=False
    )
    if records is None:
        return 2
    try:
        out = plan(args, records)
    except ValueError as exc:
        print(f"kvpool plan: {exc}", file=sys.stderr)
        return 2
    print(format_report(out))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)
            fh.write("\n")
    plot = args.plot or (args.json.rsplit(".", 1)[0] + ".png" if args.json else None)
    if plot:
        try:
            plot_curve(out, plot)
            print(f"plot: {plot}")
        except RuntimeError as exc:
            print(f"kvpool plan: no plot: {exc}", file=sys.stderr)
    return 0
