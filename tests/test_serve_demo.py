"""The README's first command: ``kvpool serve --model tiny --demo`` starts, serves, exits."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_serves_a_workload_and_exits_cleanly() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool",
            "serve",
            "--model",
            "tiny",
            "--demo",
            "--demo-requests",
            "4",
            "--block-tokens",
            "64",
            "--dram",
            "32MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = done.stdout
    assert "kvpool serve ready on http://" in out
    assert out.count("TTFT ms") == 2 and out.count("TBT ms") == 2
    assert "(0 failed)" in out and "kvpool serve stopped" in out
    hits = [line for line in out.splitlines() if "prefix hit" in line]
    assert int(hits[0].split()[2]) == 0 and int(hits[1].split()[2]) > 0  # cold, then reused
