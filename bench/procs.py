"""Start ``kvpool master`` / ``kvpool node`` processes for benchmarks and tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.procs import wait_for_ready

READY = re.compile(r"(?:ready on|on) ([\d.]+):(\d+)")


@dataclass
class Proc:
    """A started kvpool server and the HOST:PORT its ready line named."""

    popen: subprocess.Popen[str]
    host: str
    port: int
    line: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        """SIGTERM (clean shutdown), then SIGKILL after 10 s."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def stop_by_stdin(popen: subprocess.Popen[str], wait_s: float) -> None:
    """Stop a child that exits when its stdin closes; SIGKILL it after ``wait_s``."""
    with contextlib.suppress(OSError):
        assert popen.stdin is not None
        popen.stdin.close()
    try:
        popen.wait(wait_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(10)


def spawn_kvpool(
    args: Sequence[str],
    *,
    prefix: Sequence[str] = (),
    cpus: set[int] | None = None,
    timeout: float = 30.0,
) -> Proc:
    """Run ``[prefix] python -m kvpool ARGS`` and wait for its ready line."""
    popen = subprocess.Popen(
        [*prefix, sys.executable, "-m", "kvpool", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        preexec_fn=_pin(cpus),
    )
    match = wait_for_ready(popen, READY, timeout)
    return Proc(popen, match.group(1), int(match.group(2)), match.string.strip())


def _pin(cpus: set[int] | None) -> Callable[[], None] | None:
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
