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
    cuda_parts = ("GPU tier", "pinned baselines", "CUDA side streams", "tiny greedy CUDA vs CPU")
    for part in (*cuda_parts, "float32 checkpoint CUDA vs CPU", "bfloat16 checkpoint CUDA vs CPU"):
        assert "CUDA" in skipped[part], skipped
    # What does run on the CPU ran and checked its bytes.
    checks = [c["name"] for e in report["sections"].values() for c in e["checks"]]
    assert "all 12 demoted blocks read back exact into cpu" in checks
    assert "tcp torch cpu 4 MiB write+read exact (arena too)" in checks
    assert "layer-wise store+load exact bytes, every layer" in checks
    assert "kvpool serve answered every request" in checks
    for dtype in ("float32", "bfloat16"):
        assert f"{dtype} checkpoint greedy tokens reproducible on CPU" in checks
        assert f"{dtype} checkpoint logprobs reproducible on CPU" in checks
    assert report["sections"]["pinned"]["figures"]["page_lock_status"]
    assert "done: 8 sections, problems none" in log


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    from kvpool.bench.gpu_check import main

    with pytest.raises(SystemExit, match="unknown section"):
        main(["--dry-run", "--only", "tier,warp", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="SECTION=SECONDS"):
        main(["--dry-run", "--budget", "tier", "--out", str(tmp_path)])


def test_sections_run_independently_and_budgets_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each section is its own process: one that raises is recorded with its traceback,
    one that crashes (SIGSEGV) is recorded with the signal, one past its budget is killed
    and keeps what it measured; the next section still runs."""
    import argparse
    import os
    import time

    from kvpool.bench import gpu_check
    from kvpool.bench.gpu_check import Spec

    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fakes = {
        "tier": Spec(20, "gpu_fakes:broken"),
        "pinned": Spec(1, "gpu_fakes:slow"),
        "transports": Spec(20, "gpu_fakes:crash"),
        "ucx": Spec(20, "gpu_fakes:fine", ("long_tokens",)),
    }
    monkeypatch.setattr(gpu_check, "SECTIONS", fakes)
    args = argparse.Namespace(
        only=None, budget=[], total_budget=120.0, dry_run=True, out=str(tmp_path), long_tokens=7
    )
    start = time.monotonic()
    assert gpu_check.run(args) == 1
    assert time.monotonic() - start < 60
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    tier, pinned, transports, ucx = (report["sections"][n] for n in fakes)
    assert (
        tier["status"] == "error" and "boom" in tier["error"] and "Traceback" in tier["traceback"]
    )
    assert tier["figures"] == {"before": 1}
    assert pinned["status"] == "timeout" and pinned["figures"] == {"measured_before_the_kill": 42}
    assert transports["status"] == "error" and "signal 11" in transports["error"]
    assert transports["checks"][0]["name"] == "ran until the crash"
    assert ucx["status"] == "ok" and ucx["checks"][0]["ok"]
