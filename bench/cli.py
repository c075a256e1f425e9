"""``kvpool bench SUITE``: one sub-subcommand per benchmark suite."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from kvpool.args import positive_int, sizes_arg

# Suites in their own modules: (module under kvpool.bench, its register function).
SUITES = [
    ("remote", "register_remote"),
    ("layerwise", "register_layerwise"),
    ("hot", "register_hot"),
    ("serve", "register_serve"),
    ("policy_cost", "register"),
    ("cpp", "register_cpp"),
    ("idle_rtt", "register_idle_rtt"),
    ("burst", "register_burst"),  # back-to-back puts into a full pool: the mean per put
    ("messages", "register_messages"),  # CPU per control-plane message vs msgpack
    ("stream_copy", "register_copy"),  # kvpool bench copy: streaming stores vs numpy copy
    ("gpu_check", "register_gpu"),  # kvpool bench gpu: the CUDA paths (--dry-run on CPU)
    ("vllm_ttft", "register_vllm"),
    ("all", "register_all"),  # issue 17: every suite's headline ratio in one run
    ("failover", "register_failover"),  # master HA: leader kill -> first put/get
]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="storage microbenchmarks")
    suites = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)

    local = suites.add_parser("local", help="put/get_into per tier vs memcpy and O_DIRECT")
    local.add_argument("--sizes", type=sizes_arg, default="64KiB,1MiB,4MiB,16MiB")
    local.add_argument("--tiers", type=_tiers, default="dram,ssd", help="comma list of dram, ssd")
    local.add_argument("--ssd-dir", default=None, help="directory for the SSD tier (default /tmp)")
    local.add_argument("--rounds", type=positive_int, default=5)
    local.add_argument("--json", default=None, metavar="F")
    local.set_defaults(func=_run_local)

    prefix = suites.add_parser("prefix", help="block_keys + prefix_match on a 128k prompt")
    prefix.add_argument("--tokens", type=positive_int, default=131_072)
    prefix.add_argument("--catalog-blocks", type=positive_int, default=1_000_000)
    prefix.add_argument("--samples", type=positive_int, default=300)
    prefix.add_argument("--json", default=None, metavar="F")
    prefix.set_defaults(func=_run_prefix)
    for module, function in SUITES:
        getattr(importlib.import_module(f"kvpool.bench.{module}"), function)(suites)


def _tiers(text: str) -> list[str]:
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    unknown = set(tiers) - {"dram", "ssd"}
    if not tiers or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown tier(s) {sorted(unknown)}; choose from dram, ssd"
        )
    return tiers


def _run_local(args: argparse.Namespace) -> int:
    from kvpool.bench.common import print_table, write_json
    from kvpool.bench.local import run_local
    from kvpool.bench.machine import storage_facts, storage_lines

    if "ssd" in args.tiers:
        facts = storage_facts(args.ssd_dir)
        print("\n".join(storage_lines(facts)))
        if not facts["o_direct"]:
            raise SystemExit(f"kvpool bench local: no O_DIRECT at {facts['dir']}: no SSD rows")
    read_ways: list[str] = []
    rows = run_local(args.sizes, args.tiers, args.ssd_dir, args.rounds, read_ways)
    if read_ways:
        print("SSD reads: " + "; ".join(read_ways))
    print_table(rows)
    write_json(args.json, rows)
    return 0


def _run_prefix(args: argparse.Namespace) -> int:
    from kvpool.bench.common import write_json
    from kvpool.bench.prefix import run_prefix

    result = run_prefix(args.tokens, args.catalog_blocks, args.samples)
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
    return 0
