"""Section functions for tests/test_gpu_check.py: each misbehaves in one way.

They run in ``kvpool.bench.gpu_child`` processes (found through PYTHONPATH).
"""

from __future__ import annotations

import os
import signal
import time

from kvpool.bench.gpu_common import Section


def broken(s: Section) -> None:
    s.figure("before", 1)
    raise RuntimeError("boom")


def slow(s: Section) -> None:
    s.figure("measured_before_the_kill", 42)
    time.sleep(60)


def crash(s: Section) -> None:
    s.check("ran until the crash", True)
    os.kill(os.getpid(), signal.SIGSEGV)  # a native library dying under us


def fine(s: Section, value: int) -> None:
    s.check("got its input", value == 7, value)
