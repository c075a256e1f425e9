"""The ``kvpool`` command: one argparse parser, one module per subcommand.

Each module named in ``SUBCOMMANDS`` exposes ``register(subparsers)``, which
adds its parser and sets ``func`` to a callable taking the parsed args and
returning an exit code. Modules keep heavy imports (torch) inside their run
functions so ``kvpool --version`` stays fast.

One way to fail (``kvpool.failures``): bad arguments are argparse usage
errors (``kvpool.args`` types; exit status 2); an expected failure while
running is one line on stderr, ``kvpool COMMAND: error: MESSAGE``, and
exit status 1. Never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvpool import __version__
from kvpool.failures import run_command

SUBCOMMANDS: list[str] = [
    "kvpool.cluster.commands",
    "kvpool.workload.demo",
    "kvpool.serve.cli",
    "kvpool.bench.cli",
    "kvpool.workload.trace_cli",
    "kvpool.workload.cachesim_cli",
    "kvpool.serve.sched.sim.cli",
    "kvpool.serve.runtime.calibrate",
    "kvpool.serve.sched.replay_cli",
    "kvpool.serve.sched.sim.cpp_cli",
    "kvpool.serve.sched.plan_cli",
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


def command_name(args: argparse.Namespace) -> str:
    """``kvpool bench local``, ``kvpool trace synth``: the words that chose the command."""
    words = [args.command, getattr(args, "suite", None), getattr(args, "trace_command", None)]
    return " ".join(["kvpool", *(str(w) for w in words if w)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command(command_name(args), args.func, args)


if __name__ == "__main__":
    sys.exit(main())
