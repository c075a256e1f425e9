"""``kvpool replay TRACE --url URL``: replay a trace and print the summary as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvpool.args import non_negative_int, positive_float, positive_int, seconds_arg
from kvpool.serve.sched.cost_model import PrefillCostModel
from kvpool.serve.sched.replay import replay
from kvpool.workload.traces import load_for_command


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a trace against a running server (TTFT/TBT, SLOs, goodput)",
        description="Send each trace request at its (scaled) timestamp to an OpenAI-compatible "
        "/v1/completions endpoint, streaming, and report latency percentiles, SLO attainment, "
        "goodput, rejections (429) and the prefix hit ratio.",
    )
    p.add_argument("trace", help="JSON-lines trace (kvpool trace synth)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--speed", type=positive_float, default=1.0, help="arrival rate multiplier")
    p.add_argument("--limit", type=non_negative_int, default=0, help="first N requests only")
    p.add_argument(
        "--block-tokens", type=positive_int, default=512, help="tokens per trace block sent"
    )
    p.add_argument("--trace-block-tokens", type=positive_int, default=512)
    p.add_argument(
        "--scale-input",
        type=positive_float,
        default=None,
        help="prompt length factor (default block-tokens / trace-block-tokens)",
    )
    p.add_argument("--scale-output", type=positive_float, default=1.0, help="reply length factor")
    p.add_argument(
        "--max-input", type=non_negative_int, default=0, help="cap prompt tokens (0: none)"
    )
    p.add_argument(
        "--max-output", type=non_negative_int, default=0, help="cap max_tokens (0: none)"
    )
    p.add_argument(
        "--vocab-size", type=positive_int, default=256, help="token ids drawn below this"
    )
    p.add_argument("--ttft-slo", type=positive_float, default=10.0, help="x unloaded TTFT")
    p.add_argument("--tbt-slo", type=positive_float, default=5.0, help="x unloaded TBT")
    p.add_argument("--ttft-slo-s", type=seconds_arg, default=None, help="absolute TTFT SLO (s)")
    p.add_argument("--tbt-slo-s", type=seconds_arg, default=None, help="absolute TBT SLO (s)")
    p.add_argument("--cost-model", default=None, help="kvpool calibrate JSON for TTFT SLOs")
    p.add_argument("--timeout", type=seconds_arg, default=600.0, help="per-request timeout (s)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--plot", default=None, metavar="DIR", help="write latency CDF PNGs here")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    records = load_for_command(
        args.trace,
        "replay",
        block_tokens=args.trace_block_tokens,
        limit=args.limit,
        allow_empty=False,
    )
    if records is None:
        return 2
    model = PrefillCostModel.load(args.cost_model) if args.cost_model else None
    result = replay(
        args.url,
        records,
        speed=args.speed,
        block_tokens=args.block_tokens,
        scale_input=args.scale_input,
        scale_output=args.scale_output,
        max_input=args.max_input,
        max_output=args.max_output,
        vocab_size=args.vocab_size,
        ttft_mult=args.ttft_slo,
        tbt_mult=args.tbt_slo,
        ttft_slo_s=args.ttft_slo_s,
        tbt_slo_s=args.tbt_slo_s,
        cost_model=model,
        progress=not args.no_progress,
        timeout=args.timeout,
        plot_dir=args.plot,
    )
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0
