"""The ``kvpool`` command: one argparse parser, one module per subcommand.

Each module named in ``SUBCOMMANDS`` exposes ``register(subparsers)``, which
adds its parser and sets ``func`` to a callable taking the parsed args and
returning an exit code. Modules keep heavy imports (torch) inside their run
functions so ``kvpool --version`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvpool import __version__

SUBCOMMANDS: list[str] = [
    "kvpool.server_cli",
    "kvpool.demo",
    "kvpool.serve.serve_cli",
    "kvpool.bench.cli",
    "kvpool.trace_cli",
    "kvpool.cachesim_cli",
    "kvpool.serve.sim",
    "kvpool.serve.calibrate",
    "kvpool.serve.replay",
    "kvpool.serve.sim_cpp",
    "kvpool.serve.plan",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool", description="Distributed KV-cache store for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
