"""One way to fail on the command line, shared by ``kvpool`` and ``kvpool-serve``.

Bad arguments are argparse usage errors (``kvpool.args`` types; exit status
2). An expected failure while a command runs (a kvpool error, a bad value,
an unusable file or address) is one line on stderr, ``PROG: error:
MESSAGE``, and exit status 1. Never a traceback, unless
``KVPOOL_TRACEBACK=1`` asks for one (for bug reports); anything else is a
bug and does show its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kvpool.errors import KVPoolError

#: Failures a command reports as one line (anything else is a bug: traceback).
EXPECTED_FAILURES = (KVPoolError, ValueError, OSError)


#: A command's run function: parsed arguments -> exit status (None: 0).
CommandFunc = Callable[[argparse.Namespace], "int | None"]


def run_command(prog: str, func: CommandFunc, args: argparse.Namespace) -> int:
    """``func(args)`` as a command named ``prog``: its exit status, 130 on Ctrl-C, or 1
    after printing an expected failure as one line."""
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except EXPECTED_FAILURES as exc:
        if os.environ.get("KVPOOL_TRACEBACK") == "1":
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
