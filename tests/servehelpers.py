"""Start ``kvpool serve`` as a subprocess for end-to-end tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.procs import wait_for_ready

READY = re.compile(r"ready on (http://[\d.]+:\d+)")


@dataclass
class Server:
    popen: subprocess.Popen[str]
    url: str
    lines: list[str]  # everything the server printed (kept up to date by a thread)


def start_serve(args: Sequence[str], *, own_group: bool = False, timeout: float = 90) -> Server:
    """``python -m kvpool serve ARGS``, waiting for its ready line (the test fails with
    the server's output if it never comes)."""
    popen = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "serve", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        process_group=0 if own_group else None,
    )
    lines: list[str] = []
    url = wait_for_ready(popen, READY, timeout, lines).group(1)
    threading.Thread(target=lambda: lines.extend(popen.stdout or []), daemon=True).start()
    return Server(popen, url, lines)
