"""``kvpool plan TRACE``: run the capacity planner and print its report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvpool.args import (
    non_negative_int,
    non_negative_ints,
    positive_float,
    positive_int,
    positive_ints,
    share_arg,
)
from kvpool.serve.sched import plan as planner
from kvpool.serve.sched.conductor import SLO
from kvpool.serve.sched.cost_model import analytic_cluster, get_hardware
from kvpool.serve.sched.plan import CURVE_KEYS, RATE_KEYS, Planner, pool_sizing, rank_key
from kvpool.serve.sched.plan_report import format_report, plot_curve
from kvpool.serve.sched.sim.cli import add_hardware_args, layer_overhead
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.rate import RateSearch
from kvpool.workload.traces import load_for_command


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="capacity planner: prefill/decode split, smallest cluster, pool sizing",
        description=(planner.__doc__ or "").split("\n\n")[0] or None,
    )
    p.add_argument("trace", help="JSON-lines trace")
    p.add_argument("--nodes", type=positive_int, default=20, help="cluster size to split")
    p.add_argument("--slo-ttft", type=positive_float, default=10.0, help="x unloaded TTFT (P90)")
    p.add_argument("--slo-tbt", type=positive_float, default=5.0, help="x unloaded TBT (P90)")
    p.add_argument("--speed", type=positive_float, default=1.0, help="arrival rate multiplier")
    p.add_argument(
        "--cpp-groups", type=positive_ints, default="1,2", help="pipeline group sizes to try"
    )
    p.add_argument("--router", default="conductor")
    p.add_argument("--rejection", default="none")
    p.add_argument(
        "--capacity-blocks", type=non_negative_int, default=8192, help="pool blocks per node"
    )
    p.add_argument("--policy", default="lru", help="eviction policy in the cluster simulation")
    p.add_argument("--limit", type=non_negative_int, default=0, help="first N requests only")
    p.add_argument(
        "--target-speed", type=positive_float, default=None, help="for the smallest cluster"
    )
    p.add_argument("--attainment", type=share_arg, default=0.9, help="share within both SLOs")
    p.add_argument("--max-nodes", type=positive_int, default=128)
    p.add_argument("--policies", default="lru,s3fifo,leaf-s3", help="pool sizing policies")
    p.add_argument(
        "--dram-blocks",
        type=positive_ints,
        default=None,
        help="comma list (default: from the trace)",
    )
    p.add_argument(
        "--ssd-blocks",
        type=non_negative_ints,
        default=None,
        help="comma list (default: from the trace)",
    )
    p.add_argument("--no-pool-sizing", action="store_true")
    add_hardware_args(p)
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--block-tokens", type=positive_int, default=512)
    p.add_argument("--json", default=None, metavar="F")
    p.add_argument("--plot", default=None, metavar="F.png", help="default: next to --json")
    p.set_defaults(func=_run_cli)


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
        hardware=args.hardware,
        layerwise=args.layerwise,
        layer_overhead_s=layer_overhead(args),
    )
    planner = Planner(records, base, args.cpp_groups, RateSearch(attainment=args.attainment))
    if args.nodes < 2:
        raise ValueError("--nodes must be >= 2")
    curve = planner.curve(args.nodes, args.speed)
    best = max(curve, key=rank_key)
    coupled_split = {"coupled": args.nodes, "prefill": 0, "decode": 0}
    coupled = planner.run(**coupled_split, speed=args.speed)
    coupled_rate = planner.sustainable(args.speed, **coupled_split)
    target = args.speed if args.target_speed is None else args.target_speed
    smallest = planner.smallest_cluster(target, args.attainment, args.max_nodes)
    sizing: list[dict[str, Any]] = []
    if not args.no_pool_sizing:
        unique = len({k for ks in planner.keys for k in ks})
        dram = args.dram_blocks if args.dram_blocks else _fractions(unique, (32, 8, 2))
        ssd = args.ssd_blocks if args.ssd_blocks else [0, *_fractions(unique, (4, 1))]
        cost = analytic_cluster(
            args.model, get_hardware(args.hardware), block_tokens=args.block_tokens
        )
        policies = [p for p in args.policies.split(",") if p.strip()]
        sizing = pool_sizing(planner.records, planner.keys, cost, policies, dram, ssd)
    return {
        "best": {k: best[k] for k in (*CURVE_KEYS, *RATE_KEYS)},
        "curve": curve,
        "coupled_goodput_rps": coupled["goodput_rps"],
        "coupled_sustainable_rps": coupled_rate["sustainable_rps"],
        "coupled": {
            **{k: coupled[k] for k in ("goodput_rps", "ttft_slo_attainment", "tbt_slo_attainment")},
            **coupled_rate,
            "sustainable_rps_per_node": coupled_rate["sustainable_rps"] / args.nodes,
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
            "hardware": args.hardware,
            "layerwise": args.layerwise,
            "attainment": args.attainment,
            "simulations": planner.runs,
            "wall_s": time.perf_counter() - t0,
        },
    }


def _fractions(unique: int, divisors: Sequence[int]) -> list[int]:
    return sorted({max(1, unique // d) for d in divisors})


def _run_cli(args: argparse.Namespace) -> int:
    records = load_for_command(
        args.trace, "plan", block_tokens=args.block_tokens, limit=args.limit, allow_empty=False
    )
    if records is None:
        return 2
    out = plan(args, records)
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
