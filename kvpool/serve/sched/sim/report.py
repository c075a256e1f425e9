"""The simulator experiments as markdown tables (bench/RESULTS.md).

``python -m kvpool.serve.sched.sim.report TRACE [--hardware h100|a800] [--json F]``
runs, on one trace (hashing its keys once), the same simulations as these
``kvpool sim`` commands (all with ``--hardware H``) and prints one table per
question; the speeds and cluster shapes are the preset's ``Scenario`` (a
load where the resource in question is busy on the look-alike trace, ``kvpool
trace synth --profile conversation``):

1. disaggregated vs coupled of the same total size (20 nodes):
   ``kvpool sim TRACE --prefill 10 --decode 10 --speed S``,
   ``... --prefill 14 --decode 6 --speed S``, ``... --coupled 20 --speed S``;
2. routers: ``kvpool sim TRACE --prefill 10 --decode 10 --speed S --router R``;
3. rejection under overload: decode-bound with short prefill queues
   (``kvpool sim TRACE --prefill P --decode D --speed S --rejection R
   --load-series F``: rejections, goodput and the decode load's swing) and
   both pools overloaded (``--prefill P --decode D --speed S --ttft-slo M``);
4. hit ratio against pool capacity:
   ``kvpool sim TRACE --prefill 10 --decode 10 --speed S --capacity-blocks N [--policy P]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvpool.serve.sched.conductor import SLO
from kvpool.serve.sched.cost_model import HARDWARE
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


@dataclass(frozen=True)
class Scenario:
    """Speeds and cluster shapes of one report (see the module doc)."""

    speeds_split: tuple[float, ...] = (1.0, 2.0, 4.0)
    speeds_router: tuple[float, ...] = (4.0, 6.0)
    reject: tuple[tuple[int, int, float], ...] = ((10, 1, 4.0),)  # decode-bound (P, D, speed)
    reject_both: tuple[int, int, float, float] = (4, 1, 4.0, 30.0)  # P, D, speed, TTFT x
    speed_capacity: float = 4.0
    capacities: tuple[int, ...] = (0, 16, 64, 256, 1024, 4096, 16384)


#: Per hardware preset: the A800 prefills ~3x slower, so its loads are lower.
SCENARIOS = {
    "h100": Scenario(),
    "a800": Scenario(
        speeds_split=(1.0, 2.0, 4.0),
        speeds_router=(1.5, 2.0),
        reject=((10, 1, 2.0),),
        reject_both=(6, 1, 2.0, 30.0),
        speed_capacity=2.0,
    ),
}

REJECTION_ORDER = ("none", "after", "now", "predicted")


def run_all(
    trace: str, hardware: str = "h100", scenario: Scenario | None = None
) -> dict[str, list[dict[str, Any]]]:
    from kvpool.workload.cachesim import trace_keys
    from kvpool.workload.traces import load_trace

    sc = scenario or SCENARIOS[hardware]
    records = load_trace(trace)
    keys = trace_keys(records)

    def sim(**kw: Any) -> dict[str, Any]:
        r = simulate(records, SimConfig(hardware=hardware, **kw), keys=keys)
        r.pop("load_series", None)
        osc = r.pop("load_oscillation", {})
        return {**kw, **osc, **{k: v for k, v in r.items() if k != "config"}}

    out: dict[str, list[dict[str, Any]]] = {"split": [], "router": [], "reject": [], "capacity": []}
    for s in sc.speeds_split:
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
    for s in sc.speeds_router:
        for router in ("conductor", "least-loaded", "random", "cache-only"):
            out["router"].append(sim(speed=s, router=router))
    for p, d, s in sc.reject:
        for rej in REJECTION_ORDER:
            r = sim(prefill=p, decode=d, speed=s, rejection=rej, load_sample_s=1.0)
            out["reject"].append({**r, "cluster": f"{p}P + {d}D", "ttft_mult": 10.0})
    p, d, s, mult = sc.reject_both
    for rej in REJECTION_ORDER:
        r = sim(prefill=p, decode=d, speed=s, rejection=rej, slo=SLO(mult, 5.0), load_sample_s=1.0)
        r.pop("slo")
        out["reject"].append({**r, "cluster": f"{p}P + {d}D", "ttft_mult": mult})
    for policy in ("lru", "leaf"):
        for cap in sc.capacities:
            out["capacity"].append(sim(speed=sc.speed_capacity, capacity_blocks=cap, policy=policy))
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
                "decode_load_std",
                "decode_load_amplitude",
                "decode_load_period_s",
                "decode_over_capacity_share",
                "prefill_queue_amplitude_s",
                "prefill_queue_period_s",
                "mean_ttft_s",
                "tbt_slo_attainment",
                "goodput_rps",
            ],
        ),
        "Hit ratio against pool capacity (10P + 10D, blocks per prefill node):",
        table(
            res["capacity"],
            [
                "speed",
                "policy",
                "capacity_blocks",
                "hit_ratio",
                "mean_ttft_s",
                "ttft_slo_attainment",
            ],
        ),
    ]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.serve.sched.sim.report")
    p.add_argument("trace")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h100")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    res = run_all(args.trace, args.hardware)
    print(markdown(res))
    print(f"\n({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
