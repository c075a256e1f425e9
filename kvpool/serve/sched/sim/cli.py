"""``kvpool sim``: simulate a cluster serving a trace and print the result as JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from kvpool.args import non_negative_int, positive_float, positive_int, seconds_arg, share_arg
from kvpool.serve.sched.admission import REJECTIONS
from kvpool.serve.sched.conductor import ROUTE_FNS, SLO
from kvpool.serve.sched.cost_model import HARDWARE
from kvpool.serve.sched.layerwise_model import DEFAULT_LAYER_OVERHEAD_S, overhead_from_bench
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.runner import simulate

# -- CLI ------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="simulate a cluster serving a trace (conductor, routers, rejection policies)",
        description="Discrete-event simulation of a llama2-70b cluster of 8-GPU nodes serving "
        "a JSON-lines trace with the real conductor, index and eviction policies.",
    )
    p.add_argument("trace", help="JSON-lines trace (kvpool trace synth)")
    p.add_argument("--prefill", type=non_negative_int, default=10, help="prefill nodes")
    p.add_argument("--decode", type=non_negative_int, default=10, help="decode nodes")
    p.add_argument(
        "--coupled", type=non_negative_int, default=0, help="N coupled prefill+decode nodes instead"
    )
    p.add_argument("--speed", type=positive_float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--router", choices=sorted(ROUTE_FNS), default="conductor")
    p.add_argument(
        "--rejection",
        choices=REJECTIONS,
        default="none",
        help="none | now (= early: on the decode load now) | after (only after prefill) "
        "| predicted (decode load predicted at prefill end)",
    )
    p.add_argument(
        "--capacity-blocks", type=non_negative_int, default=8192, help="pool blocks per node"
    )
    p.add_argument("--policy", default="lru", help="eviction policy (kvpool.eviction names)")
    p.add_argument("--ttft-slo", type=positive_float, default=10.0, help="x unloaded TTFT (P90)")
    p.add_argument("--tbt-slo", type=positive_float, default=5.0, help="x unloaded TBT (P90)")
    p.add_argument("--balance-threshold", type=share_arg, default=0.8)
    p.add_argument(
        "--decode-headroom",
        type=share_arg,
        default=0.9,
        help="admission targets this share of the decode pool's capacity",
    )
    p.add_argument("--block-tokens", type=positive_int, default=512)
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--limit", type=non_negative_int, default=0, help="first N requests only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpp-group", type=positive_int, default=1, help="pipeline prefill over k nodes"
    )
    add_hardware_args(p)
    p.add_argument(
        "--find-rate",
        action="store_true",
        help="search the speed for the highest rate that keeps --attainment of requests "
        "within both SLOs; adds sustainable_rps and sustainable_speed to the JSON",
    )
    p.add_argument(
        "--attainment",
        type=share_arg,
        default=0.9,
        help="with --find-rate: share of requests within both SLOs (default 0.9)",
    )
    p.add_argument(
        "--load-series",
        default=None,
        metavar="F",
        help="write the prefill queue and decode load over time here (JSON; the result "
        "gets load_oscillation); a .png name draws them instead (matplotlib)",
    )
    p.add_argument(
        "--load-interval", type=seconds_arg, default=1.0, help="seconds between load samples"
    )
    p.add_argument("--json", default=None, help="write the result object here")
    p.set_defaults(func=_run_cli)


def add_hardware_args(p: Any) -> None:
    """``--hardware`` and the layer-wise streaming flags (``kvpool sim`` and ``kvpool plan``)."""
    p.add_argument(
        "--hardware",
        choices=sorted(HARDWARE),
        default="h100",
        help="node preset: h100 (8 x H100 SXM) or a800 (the paper's 8 x A800-80GB + RDMA)",
    )
    p.add_argument(
        "--no-layerwise",
        dest="layerwise",
        action="store_false",
        help="move the KV to decode only after prefill, at full size (no layer-wise streaming)",
    )
    p.add_argument(
        "--layerwise-calibration",
        default=None,
        metavar="F",
        help="a kvpool bench layerwise --json result: fit the per-layer overhead from it",
    )


def layer_overhead(args: argparse.Namespace) -> float:
    """The per-layer streaming overhead: fitted from ``--layerwise-calibration``, or the default."""
    if not args.layerwise_calibration:
        return DEFAULT_LAYER_OVERHEAD_S
    with open(args.layerwise_calibration, encoding="utf-8") as fh:
        return overhead_from_bench(json.load(fh))


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
        hardware=args.hardware,
        layerwise=args.layerwise,
        layer_overhead_s=layer_overhead(args),
        load_sample_s=args.load_interval if args.load_series else 0.0,
    )
    result = _with_rate(records, cfg, args.attainment) if args.find_rate else simulate(records, cfg)
    series = result.pop("load_series", None)
    if args.load_series and series is not None:
        _write_series(args.load_series, series, result, args.rejection)
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


def _with_rate(records: Any, cfg: SimConfig, attainment: float) -> dict[str, Any]:
    """The result at ``cfg.speed`` plus the sustainable rate (``sim.rate``)."""
    from kvpool.serve.sched.sim.rate import RateSearch, sim_find_rate
    from kvpool.workload.cachesim import trace_keys

    keys = trace_keys(records, cfg.block_tokens)
    result = simulate(records, cfg, keys=keys)
    search = RateSearch(attainment=attainment)
    rate = sim_find_rate(records, replace(cfg, load_sample_s=0.0), search, keys=keys)
    rate.pop("at_sustainable")
    return {**result, **rate}


def _write_series(path: str, series: Any, result: dict[str, Any], label: str) -> None:
    if path.endswith(".png"):
        from kvpool.serve.sched.sim.load_series import plot

        plot({label: series}, path)
        return
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"oscillation": result["load_oscillation"], "series": series}, fh)
        fh.write("\n")
