"""The ``kvpool`` command: one argparse parser, one module per subcommand.

Each module named in ``SUBCOMMANDS`` exposes ``register(subparsers)``, which
adds its parser and sets ``func`` to a callable taking the parsed args and
returning an exit code. Modules keep heavy imports (torch) inside their run
functions so ``kvpool --version`` stays fast.

One way to fail: bad arguments are argparse usage errors (``kvpool.args``
types; exit status 2); an expected failure while running (a kvpool error,
a bad value, an unusable file or address) is one line on stderr,
``kvpool COMMAND: error: MESSAGE``, and exit status 1. Never a traceback,
unless ``KVPOOL_TRACEBACK=1`` asks for one (for bug reports).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvpool import __version__
from kvpool.errors import KVPoolError

#: Failures a command reports as one line (anything else is a bug: traceback).
EXPECTED_FAILURES = (KVPoolError, ValueError, OSError)

SUBCOMMANDS: list[str] = [
    "kvpool.cluster.commands",
    "kvpool.workload.demo",
    "kvpool.serve.cli",
    "kvpool.bench.cli",
    "kvpool.workload.trace_cli",
    "kvpool.workload.cachesim_cli",
    "kvpool.serve.sched.sim.cluster",
    "kvpool.serve.runtime.calibrate",
    "kvpool.serve.sched.replay",
    "kvpool.serve.sched.sim.cpp",
    "kvpool.serve.sched.plan",
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
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except EXPECTED_FAILURES as exc:
        if os.environ.get("KVPOOL_TRACEBACK") == "1":
            raise
        print(f"{command_name(args)}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
