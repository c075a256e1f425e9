"""``kvpool sim``: simulate a cluster serving a trace and print the result as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvpool.args import non_negative_int, positive_int
from kvpool.serve.sched.admission import REJECTIONS
from kvpool.serve.sched.conductor import ROUTE_FNS, SLO
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
    p.add_argument("--speed", type=float, default=1.0, help="arrival rate multiplier")
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
    p.add_argument("--ttft-slo", type=float, default=10.0, help="x unloaded TTFT (P90)")
    p.add_argument("--tbt-slo", type=float, default=5.0, help="x unloaded TBT (P90)")
    p.add_argument("--balance-threshold", type=float, default=0.8)
    p.add_argument(
        "--decode-headroom",
        type=float,
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
    result = simulate(records, cfg)
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0
