"""Waiting for a child process's ready line, with a real timeout.

Servers print one line naming where they listen once they are ready; callers
wait for it. ``readline`` alone could block forever on a silent child, so
this polls the pipe with a deadline.
"""

from __future__ import annotations

import re
import selectors
import subprocess
import time


def wait_for_ready(
    popen: subprocess.Popen[str],
    pattern: re.Pattern[str],
    timeout: float,
    lines: list[str] | None = None,
) -> re.Match[str]:
    """The first stdout line matching ``pattern``; RuntimeError (child killed) if the
    child exits, or ``timeout`` seconds pass, first. Every line read is appended to
    ``lines`` when given (for diagnostics)."""
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(popen.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                continue
            line = popen.stdout.readline()
            if not line:
                break
            if lines is not None:
                lines.append(line)
            match = pattern.search(line)
            if match:
                return match
    popen.kill()
    popen.wait(10)
    seen = "".join(lines or [])[-2000:]
    raise RuntimeError(f"{popen.args!r} did not become ready within {timeout} s: {seen}")
