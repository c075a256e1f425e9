"""``kvpool trace``: synthesize traces (``synth``) and summarise them (``stats``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvpool.args import non_negative_float, positive_float, positive_int, share_arg
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
        description="Seeded synthetic trace. --profile synthetic (default): Zipf-popular "
        "system prompts, multi-turn sessions whose prompts extend each other, one-off "
        "documents, Poisson arrivals. --profile conversation: a look-alike of a production "
        "chat trace's shape (heavy-tailed prompts, short sessions, non-IID think times, "
        "short Zipf-popular system prompts, most blocks used once, sessions returning after "
        "thousands of other blocks; kvpool.workload.conversation).",
    )
    synth.add_argument(
        "--profile",
        choices=PROFILES,
        default="synthetic",
        help="trace shape (default synthetic); conversation takes --requests, --seed, --rate, "
        "--mean-turns, --system-prompts, --zipf, --think-time, --max-input-tokens, "
        "--block-tokens",
    )
    synth.add_argument("--requests", type=int, default=d.requests, help="number of requests")
    synth.add_argument("--seed", type=int, default=d.seed)
    synth.add_argument("--out", default=None, help="output file (default: stdout)")
    opt = synth.add_argument  # options whose default depends on the profile: None = its default
    opt("--rate", type=positive_float, default=None, help=f"mean requests per second ({d.rate})")
    opt(
        "--sessions",
        type=positive_int,
        default=None,
        help="number of chat sessions (default: derived)",
    )
    opt("--mean-turns", type=positive_float, default=None, help=f"({d.mean_turns})")
    opt(
        "--think-time",
        type=non_negative_float,
        default=None,
        help=f"seconds: synthetic, the mean think time ({d.think_time_s}); conversation, "
        "the median time spent on the next message at 8k tokens of context (60; reading "
        "the reply and breaks come on top)",
    )
    opt(
        "--think-sigma",
        type=non_negative_float,
        default=None,
        help=f"lognormal shape of think times, 0 = exponential ({d.think_sigma})",
    )
    opt("--doc-fraction", type=share_arg, default=None, help=f"({d.doc_fraction})")
    opt("--system-prompts", type=positive_int, default=None, help=f"({d.system_prompts})")
    opt(
        "--zipf", type=non_negative_float, default=None, help=f"system prompt popularity ({d.zipf})"
    )
    opt("--system-tokens", type=positive_int, default=None, help=f"median ({d.system_tokens})")
    opt("--user-tokens", type=positive_int, default=None, help=f"median ({d.user_tokens})")
    opt("--reply-tokens", type=positive_int, default=None, help=f"median ({d.reply_tokens})")
    opt("--doc-tokens", type=positive_int, default=None, help=f"median ({d.doc_tokens})")
    opt("--max-input-tokens", type=positive_int, default=None, help=f"({d.max_input_tokens})")
    synth.add_argument("--block-tokens", type=positive_int, default=d.block_tokens)
    synth.set_defaults(func=_run_synth)

    stats = sub.add_parser("stats", help="summarise a trace (requests, blocks, reuse)")
    stats.add_argument("trace")
    stats.add_argument("--block-tokens", type=positive_int, default=DEFAULT_BLOCK_TOKENS)
    stats.set_defaults(func=_run_stats)


PROFILES = ("synthetic", "conversation")
# argparse dest -> (SynthConfig field, ConversationConfig field or None when not used)
_PROFILE_FIELDS = {
    "rate": ("rate", "rate"),
    "sessions": ("sessions", None),
    "mean_turns": ("mean_turns", "mean_turns"),
    "think_time": ("think_time_s", "think_median_s"),
    "think_sigma": ("think_sigma", None),
    "doc_fraction": ("doc_fraction", None),
    "system_prompts": ("system_prompts", "system_prompts"),
    "zipf": ("zipf", "zipf"),
    "system_tokens": ("system_tokens", None),
    "user_tokens": ("user_tokens", None),
    "reply_tokens": ("reply_tokens", None),
    "doc_tokens": ("doc_tokens", None),
    "max_input_tokens": ("max_input_tokens", "max_input_tokens"),
}


def synth_records(args: argparse.Namespace) -> list[Any]:
    """The records ``kvpool trace synth`` writes; ValueError on options the profile
    does not take or values it rejects."""
    from kvpool.workload.conversation import conversation_trace
    from kvpool.workload.synth import synthesize

    conversation = args.profile == "conversation"
    kw: dict[str, Any] = {
        "requests": args.requests,
        "seed": args.seed,
        "block_tokens": args.block_tokens,
    }
    for dest, (synth_field, conv_field) in _PROFILE_FIELDS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        name = conv_field if conversation else synth_field
        if name is None:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag} does not apply to --profile {args.profile}")
        kw[name] = value
    return conversation_trace(**kw) if conversation else synthesize(**kw)


def _run_synth(args: argparse.Namespace) -> int:
    from kvpool.workload.traces import write_trace

    try:
        records = synth_records(args)
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
    """Counts over full blocks (the ones the pool keys), by hash-id prefix, then the
    shape numbers of ``conversation.shape_stats`` (quantiles, block reuse)."""
    from kvpool.workload.conversation import shape_stats

    n = len(records)
    shape = shape_stats(records, block_tokens)
    head = {
        "requests": n,
        "blocks": shape.get("blocks", 0),
        "unique_blocks": shape.get("unique_blocks", 0),
        "infinite_hit_ratio": shape.get("infinite_hit_ratio", 0.0),
        "mean_input_tokens": shape.get("prompt_mean", 0.0),
        "duration_s": (records[-1].timestamp - records[0].timestamp) / 1000.0 if n else 0.0,
    }
    return {**head, **{k: v for k, v in shape.items() if k not in head}}


def _run_stats(args: argparse.Namespace) -> int:
    from kvpool.workload.traces import load_for_command

    records = load_for_command(args.trace, "trace stats", block_tokens=args.block_tokens)
    if records is None:
        return 2
    print(json.dumps(trace_stats(records, args.block_tokens), indent=2))
    return 0
