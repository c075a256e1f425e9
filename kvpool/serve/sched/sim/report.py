"""The issue-7 simulator experiments as markdown tables (bench/RESULTS.md).

``python -m kvpool.serve.sched.sim.report TRACE [--json F]`` runs, on one trace
(hashing its keys once), the same simulations as these ``kvpool sim``
commands and prints one table per question:

1. disaggregated vs coupled of the same total size (20 nodes):
   ``kvpool sim TRACE --prefill 10 --decode 10 --speed S``,
   ``... --prefill 14 --decode 6 --speed S``, ``... --coupled 20 --speed S``;
2. routers: ``kvpool sim TRACE --prefill 10 --decode 10 --speed S --router R``;
3. rejection under overload: decode-bound with short prefill queues
   (``kvpool sim TRACE --prefill 10 --decode 3 --speed S --rejection P``) and
   both pools overloaded with long prefill queues
   (``kvpool sim TRACE --prefill 4 --decode 2 --speed 8 --ttft-slo 30 --rejection P``);
4. hit ratio against pool capacity:
   ``kvpool sim TRACE --prefill 10 --decode 10 --speed 5 --capacity-blocks N [--policy P]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvpool.serve.sched.conductor import SLO
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.runner import simulate


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def run_all(
    trace: str,
    *,
    speeds_split: tuple[float, ...] = (5.0, 10.0, 15.0),
    speeds_router: tuple[float, ...] = (10.0, 15.0),
    speeds_reject: tuple[float, ...] = (10.0, 14.0),
    capacities: tuple[int, ...] = (0, 16, 64, 256, 1024, 4096, 16384),
) -> dict[str, list[dict[str, Any]]]:
    from kvpool.workload.cachesim import trace_keys
    from kvpool.workload.traces import load_trace

    records = load_trace(trace)
    keys = trace_keys(records)

    def sim(**kw: Any) -> dict[str, Any]:
        r = simulate(records, SimConfig(**kw), keys=keys)
        return {**kw, **{k: v for k, v in r.items() if k != "config"}}

    out: dict[str, list[dict[str, Any]]] = {"split": [], "router": [], "reject": [], "capacity": []}
    for s in speeds_split:
        for kw in (
            {"prefill": 10, "decode": 10},
            {"prefill": 14, "decode": 6},
            {"coupled": 20},
        ):
            r = sim(speed=s, **kw)
            r["cluster"] = (
                f"coupled {kw['coupled']}"
                if "coupled" in kw
                else (f"{kw['prefill']}P + {kw['decode']}D")
            )
            out["split"].append(r)
    for s in speeds_router:
        for router in ("conductor", "least-loaded", "random", "cache-only"):
            out["router"].append(sim(speed=s, router=router))
    for s in speeds_reject:
        for rej in ("none", "after", "now", "predicted"):
            r = sim(prefill=10, decode=3, speed=s, rejection=rej)
            out["reject"].append({**r, "cluster": "10P + 3D", "ttft_mult": 10.0})
    for rej in ("none", "after", "now", "predicted"):
        r = sim(prefill=4, decode=2, speed=8.0, rejection=rej, slo=SLO(30.0, 5.0))
        r.pop("slo")
        out["reject"].append({**r, "cluster": "4P + 2D", "ttft_mult": 30.0})
    for policy in ("lru", "leaf"):
        for cap in capacities:
            out["capacity"].append(sim(speed=5.0, capacity_blocks=cap, policy=policy))
    return out


def markdown(res: dict[str, list[dict[str, Any]]]) -> str:
    parts = [
        "Disaggregated vs coupled (20 nodes):",
        table(
            res["split"],
            [
                "speed",
                "cluster",
                "tbt_slo_attainment",
                "ttft_slo_attainment",
                "goodput_rps",
                "mean_ttft_s",
                "mean_tbt_s",
            ],
        ),
        "Routers (10P + 10D):",
        table(
            res["router"],
            [
                "speed",
                "router",
                "ttft_slo_attainment",
                "mean_ttft_s",
                "p90_ttft_s",
                "hit_ratio",
                "fetches",
                "goodput_rps",
            ],
        ),
        "Rejection under overload:",
        table(
            res["reject"],
            [
                "cluster",
                "speed",
                "ttft_mult",
                "rejection",
                "rejected",
                "rejected_ttft",
                "rejected_decode",
                "rejected_after_prefill",
                "wasted_prefill_s",
                "mean_ttft_s",
                "tbt_slo_attainment",
                "goodput_rps",
            ],
        ),
        "Hit ratio against pool capacity (10P + 10D, speed 5, blocks per prefill node):",
        table(
            res["capacity"],
            ["policy", "capacity_blocks", "hit_ratio", "mean_ttft_s", "ttft_slo_attainment"],
        ),
    ]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.serve.sched.sim.report")
    p.add_argument("trace")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    res = run_all(args.trace)
    print(markdown(res))
    print(f"\n({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
