"""``kvpool sim-cpp``: the TTFT-vs-prompt-length table of ``pipeline_model.ttft_curve``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvpool.args import positive_ints
from kvpool.serve.sched.cost_model import analytic_cluster
from kvpool.serve.sched.pipeline_model import PROMPT_LENGTHS, ttft_curve


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim-cpp",
        help="TTFT vs prompt length: single node, pipeline (CPP) and cross-node TP",
        description="Unloaded TTFT of one prompt on the simulator's nodes (llama2-70b on 8 x "
        "H100 by default): a single node, chunked pipeline prefill over k nodes, and cross-node "
        "tensor parallelism over k nodes (two all-reduces per layer over 100 GB/s).",
    )
    p.add_argument("--model", default="llama2-70b")
    p.add_argument(
        "--lengths", type=positive_ints, default=",".join(str(n) for n in PROMPT_LENGTHS)
    )
    p.add_argument("--groups", type=positive_ints, default="2,4", help="node counts for CPP and TP")
    p.add_argument("--json", default=None, metavar="F")
    p.set_defaults(func=_run_cli)


def format_curve(rows: list[dict[str, Any]], groups: tuple[int, ...]) -> str:
    head = ["tokens", "single s"]
    for k in groups:
        head += [f"CPP{k} s", f"CPP{k} bubble", f"TP{k} s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['tokens']:,}", f"{r['single_s']:.2f}"]
        for k in groups:
            cells += [
                f"{r[f'cpp{k}_s']:.2f} ({r['single_s'] / r[f'cpp{k}_s']:.2f}x)",
                f"{r[f'cpp{k}_bubble']:.3f}",
                f"{r[f'tp{k}_s']:.2f} ({r['single_s'] / r[f'tp{k}_s']:.2f}x)",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_cli(args: argparse.Namespace) -> int:
    lengths, groups = tuple(args.lengths), tuple(args.groups)
    cost = analytic_cluster(args.model)
    rows = ttft_curve(cost, lengths, groups)
    print(format_curve(rows, groups))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"model": args.model, "rows": rows}, fh, indent=2)
            fh.write("\n")
    return 0
