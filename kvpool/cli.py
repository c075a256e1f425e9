"""The ``kvpool`` command: one argparse parser, one module per subcommand.

Each module named in ``COMMANDS`` exposes ``register(subparsers)``, which
adds its command's parser and sets ``func`` to a callable taking the parsed
args and returning an exit code. Modules keep heavy imports (torch) inside
their run functions. ``kvpool COMMAND ...`` imports only that command's
module, so a master or a node starts without loading the serving, simulation
and benchmark code; ``kvpool --help`` and anything unknown get the full
parser.

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

#: Command -> the module whose ``register`` adds it, in ``kvpool --help`` order.
COMMANDS: dict[str, str] = {
    "master": "kvpool.cluster.commands",
    "node": "kvpool.cluster.commands",
    "demo": "kvpool.workload.demo",
    "serve": "kvpool.serve.cli",
    "bench": "kvpool.bench.cli",
    "trace": "kvpool.workload.trace_cli",
    "cachesim": "kvpool.workload.cachesim_cli",
    "sim": "kvpool.serve.sched.sim.cli",
    "calibrate": "kvpool.serve.runtime.calibrate",
    "replay": "kvpool.serve.sched.replay_cli",
    "sim-cpp": "kvpool.serve.sched.sim.cpp_cli",
    "plan": "kvpool.serve.sched.plan_cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvpool`` parser with every command, or only ``command`` (when known)."""
    parser = argparse.ArgumentParser(
        prog="kvpool", description="Distributed KV-cache store for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module_name in dict.fromkeys(modules):
        importlib.import_module(module_name).register(subparsers)
    return parser


def command_name(args: argparse.Namespace) -> str:
    """``kvpool bench local``, ``kvpool trace synth``: the words that chose the command."""
    words = [args.command, getattr(args, "suite", None), getattr(args, "trace_command", None)]
    return " ".join(["kvpool", *(str(w) for w in words if w)])


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words else None)
    args = parser.parse_args(words)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command(command_name(args), args.func, args)


if __name__ == "__main__":
    sys.exit(main())
