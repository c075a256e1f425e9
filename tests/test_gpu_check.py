"""``kvpool bench gpu --dry-run``: every section's code path on the CPU, skipped parts named.

The GPU run itself needs a CUDA machine (bench/gpu_check.sh); this keeps the
script working in CI: it must run, pass every check it can run here, and
name what it skipped and why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench.gpu_check import SECTIONS


def test_dry_run_runs_every_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "gpu", "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    log = (tmp_path / "gpu_check.log").read_text()
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["machine"]["cpus"] and "torch_version" in report["machine"]
    assert list(report["sections"]) == list(SECTIONS)
    skipped = {}
    for name, entry in report["sections"].items():
        assert entry["status"] == "ok", (name, entry)
        assert all(c["ok"] for c in entry["checks"]), (name, entry["checks"])
        for part in entry["skipped"]:
            assert part["part"] and part["reason"], (name, part)
            skipped[part["part"]] = part["reason"]
    # Every CUDA-only part is named with its reason, never dropped silently.
    for part in ("GPU tier", "pinned baselines", "CUDA side streams", "tiny greedy CUDA vs CPU"):
        assert "CUDA" in skipped[part], skipped
    # What does run on the CPU ran and checked its bytes.
    checks = [c["name"] for e in report["sections"].values() for c in e["checks"]]
    assert "all 12 demoted blocks read back exact into cpu" in checks
    assert "tcp torch cpu 4 MiB write+read exact (arena too)" in checks
    assert "layer-wise store+load exact bytes, every layer" in checks
    assert "kvpool serve answered every request" in checks
    assert report["sections"]["pinned"]["figures"]["page_lock_status"]
    assert "done: 7 sections, problems none" in log


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    from kvpool.bench.gpu_check import main

    with pytest.raises(SystemExit, match="unknown section"):
        main(["--dry-run", "--only", "tier,warp", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="SECTION=SECONDS"):
        main(["--dry-run", "--budget", "tier", "--out", str(tmp_path)])


def test_sections_run_independently_and_budgets_hold(tmp_path: Path) -> None:
    """A section that raises is recorded with its traceback; the next one still runs;
    a section past its budget is cut off and recorded as a timeout."""
    import argparse
    import time

    from kvpool.bench import gpu_check

    def broken(s: object, args: object) -> None:
        raise RuntimeError("boom")

    def slow(s: object, args: object) -> None:
        time.sleep(30)

    sections = {
        "tier": (5, broken),
        "pinned": (0.2, slow),
        "ucx": (5, gpu_check.SECTIONS["ucx"][1]),
    }
    original = dict(gpu_check.SECTIONS)
    gpu_check.SECTIONS.clear()
    gpu_check.SECTIONS.update(sections)
    try:
        args = argparse.Namespace(
            only=None, budget=["pinned=0.2"], total_budget=60.0, dry_run=True, out=str(tmp_path)
        )
        start = time.monotonic()
        assert gpu_check.run(args) == 1
        assert time.monotonic() - start < 20
    finally:
        gpu_check.SECTIONS.clear()
        gpu_check.SECTIONS.update(original)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    tier, pinned, ucx = (report["sections"][n] for n in ("tier", "pinned", "ucx"))
    assert (
        tier["status"] == "error" and "boom" in tier["error"] and "Traceback" in tier["traceback"]
    )
    assert pinned["status"] == "timeout"
    assert ucx["status"] == "ok"
