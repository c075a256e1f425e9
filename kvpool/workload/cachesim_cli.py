"""``kvpool cachesim TRACE``: block prefix-hit ratio of eviction policies on a trace."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.workload.traces import TraceRecord


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("capacities must be non-negative integers")
    return values


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cachesim",
        help="replay a trace through eviction policies (block prefix-hit ratio)",
        description="Replays a JSON-lines trace through the real block index and the "
        "eviction policies (no data). Prints each policy's block prefix-hit ratio at each "
        "capacity, Belady's (offline optimum with bypass) and the infinite-capacity ratio.",
    )
    parser.add_argument("trace", help="JSON-lines trace (timestamp, input_length, ...)")
    parser.add_argument(
        "--capacity-blocks",
        type=_int_list,
        default=[1000, 5000, 10000],
        help="comma-separated capacities in blocks (default 1000,5000,10000)",
    )
    parser.add_argument(
        "--policy",
        type=_name_list,
        default=None,
        help="comma-separated policy names (default: every online policy)",
    )
    parser.add_argument(
        "--json", default=None, metavar="F", help="also write rows to F ('-' = stdout)"
    )
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--no-belady", action="store_true", help="skip the oracle rows")
    parser.add_argument(
        "--bound",
        action="store_true",
        help="add the keep-for-H bound rows (keep-for-h, keep-for-h+oracle): the best "
        "hit ratio of policies that keep each block a fixed time after each use "
        "(optimistic; see kvpool.eviction.horizon)",
    )
    parser.set_defaults(func=run)


def format_table(rows: list[dict[str, Any]]) -> str:
    caps = sorted({r["capacity_blocks"] for r in rows if r["capacity_blocks"] is not None})
    by = {(r["policy"], r["capacity_blocks"]): r["hit_ratio"] for r in rows}
    names = list(dict.fromkeys(r["policy"] for r in rows if r["capacity_blocks"] is not None))
    belady = {c: by.get(("belady", c)) for c in caps}
    head = ["policy", *[f"{c} blocks" for c in caps]]
    lines = [head]
    for name in names:
        cells = [name]
        for c in caps:
            v = by.get((name, c))
            b = belady.get(c)
            if v is None:
                cells.append("-")
            elif name != "belady" and b:
                cells.append(f"{v:.4f} ({v / b:.2f}x)")
            else:
                cells.append(f"{v:.4f}")
        lines.append(cells)
    inf = by.get(("infinite", None))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in lines]
    if inf is not None:
        out.append(f"infinite capacity: {inf:.4f}")
    return "\n".join(out)


def _bound_rows(
    records: Sequence[TraceRecord], requests: list[list[bytes]], capacities: list[int]
) -> list[dict[str, Any]]:
    from kvpool.eviction.horizon import keep_for_h_bound

    timestamps_s = [rec.timestamp / 1000.0 for rec in records]
    rows: list[dict[str, Any]] = []
    for name, oracle in (("keep-for-h", False), ("keep-for-h+oracle", True)):
        ratios = keep_for_h_bound(requests, timestamps_s, capacities, reuse_oracle=oracle)
        rows += [
            {"policy": name, "capacity_blocks": cap, "hit_ratio": ratio}
            for cap, ratio in zip(capacities, ratios, strict=True)
        ]
    return rows


def run(args: argparse.Namespace) -> int:
    from kvpool.eviction import ONLINE_POLICIES, POLICIES
    from kvpool.workload.cachesim import run_cachesim, trace_keys
    from kvpool.workload.traces import load_for_command

    policies = args.policy if args.policy is not None else list(ONLINE_POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(
            f"kvpool cachesim: unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}",
            file=sys.stderr,
        )
        return 2
    want_belady = not args.no_belady
    if "belady" in policies:
        policies = [p for p in policies if p != "belady"]
        want_belady = True
    records = load_for_command(args.trace, "cachesim", block_tokens=args.block_tokens)
    if records is None:
        return 2
    requests = trace_keys(records, block_tokens=args.block_tokens)
    rows = run_cachesim(requests, args.capacity_blocks, policies, belady=want_belady)
    if args.bound:
        try:
            bound = _bound_rows(records, requests, args.capacity_blocks)
        except ValueError as exc:
            print(f"kvpool cachesim: --bound: {exc}", file=sys.stderr)
            return 2
        rows[-1:-1] = bound  # before the infinite row, which stays last
    unique = len({k for keys in requests for k in keys})
    total = sum(len(keys) for keys in requests)
    if args.json == "-":
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{len(records)} requests, {total} blocks, {unique} unique blocks")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
            fh.write("\n")
    return 0
