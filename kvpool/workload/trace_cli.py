"""``kvpool trace``: synthesize traces (``synth``) and summarise them (``stats``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvpool.workload.synth import SynthConfig
from kvpool.workload.traces import DEFAULT_BLOCK_TOKENS


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("trace", help="synthesize or inspect request traces")
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    parser.set_defaults(func=lambda _args: (parser.print_help(), 2)[1])

    d = SynthConfig()
    synth = sub.add_parser(
        "synth",
        help="write a synthetic JSON-lines trace (system prompts, sessions, documents)",
        description="Seeded synthetic trace: Zipf-popular system prompts, multi-turn "
        "sessions whose prompts extend each other, one-off documents, Poisson arrivals.",
    )
    synth.add_argument("--requests", type=int, default=d.requests, help="number of requests")
    synth.add_argument("--seed", type=int, default=d.seed)
    synth.add_argument("--out", default=None, help="output file (default: stdout)")
    synth.add_argument("--rate", type=float, default=d.rate, help="mean requests per second")
    synth.add_argument(
        "--sessions", type=int, default=None, help="number of chat sessions (default: derived)"
    )
    synth.add_argument("--mean-turns", type=float, default=d.mean_turns)
    synth.add_argument("--think-time", type=float, default=d.think_time_s, help="seconds (mean)")
    synth.add_argument(
        "--think-sigma",
        type=float,
        default=d.think_sigma,
        help="lognormal shape of think times (0 = exponential)",
    )
    synth.add_argument("--doc-fraction", type=float, default=d.doc_fraction)
    synth.add_argument("--system-prompts", type=int, default=d.system_prompts)
    synth.add_argument("--zipf", type=float, default=d.zipf, help="system prompt popularity")
    synth.add_argument("--system-tokens", type=int, default=d.system_tokens, help="median")
    synth.add_argument("--user-tokens", type=int, default=d.user_tokens, help="median")
    synth.add_argument("--reply-tokens", type=int, default=d.reply_tokens, help="median")
    synth.add_argument("--doc-tokens", type=int, default=d.doc_tokens, help="median")
    synth.add_argument("--max-input-tokens", type=int, default=d.max_input_tokens)
    synth.add_argument("--block-tokens", type=int, default=d.block_tokens)
    synth.set_defaults(func=_run_synth)

    stats = sub.add_parser("stats", help="summarise a trace (requests, blocks, reuse)")
    stats.add_argument("trace")
    stats.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    stats.set_defaults(func=_run_stats)


def _run_synth(args: argparse.Namespace) -> int:
    from kvpool.workload.synth import synthesize
    from kvpool.workload.traces import write_trace

    cfg = SynthConfig(
        requests=args.requests,
        seed=args.seed,
        rate=args.rate,
        doc_fraction=args.doc_fraction,
        sessions=args.sessions,
        mean_turns=args.mean_turns,
        think_time_s=args.think_time,
        think_sigma=args.think_sigma,
        system_prompts=args.system_prompts,
        zipf=args.zipf,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        reply_tokens=args.reply_tokens,
        doc_tokens=args.doc_tokens,
        max_input_tokens=args.max_input_tokens,
        block_tokens=args.block_tokens,
    )
    try:
        records = synthesize(cfg)
    except ValueError as exc:
        print(f"kvpool trace synth: {exc}", file=sys.stderr)
        return 2
    if args.out in (None, "-"):
        write_trace(records, sys.stdout)
    else:
        write_trace(records, args.out)
        print(f"wrote {len(records)} requests to {args.out}", file=sys.stderr)
    return 0


def trace_stats(records: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> dict[str, Any]:
    """Counts over full blocks (the ones the pool keys), by hash-id prefix."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    first_ts = last_ts = 0.0
    for i, rec in enumerate(records):
        if i == 0:
            first_ts = rec.timestamp
        last_ts = rec.timestamp
        full = rec.input_length // block_tokens
        total += full
        for j in range(1, full + 1):
            seen.add(tuple(rec.hash_ids[:j]))
    n = len(records)
    return {
        "requests": n,
        "blocks": total,
        "unique_blocks": len(seen),
        "infinite_hit_ratio": (total - len(seen)) / total if total else 0.0,
        "mean_input_tokens": sum(r.input_length for r in records) / n if n else 0.0,
        "duration_s": (last_ts - first_ts) / 1000.0,
    }


def _run_stats(args: argparse.Namespace) -> int:

    from kvpool.workload.traces import load_for_command

    records = load_for_command(args.trace, "trace stats", block_tokens=args.block_tokens)
    if records is None:
        return 2
    print(json.dumps(trace_stats(records, args.block_tokens), indent=2))
    return 0
