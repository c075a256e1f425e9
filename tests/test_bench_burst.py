"""Smoke test of ``kvpool bench burst``: a small pool, short bursts, the JSON's shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpool.bench.burst import register_burst, run_burst


def test_bench_burst_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    register_burst(parser.add_subparsers(dest="suite"))
    out = tmp_path / "rows.json"
    small = ["--sizes", "64KiB", "--pool", "8MiB", "--burst", "64", "--bursts", "2"]
    args = parser.parse_args(["burst", *small, "--json", str(out)])
    assert args.func(args) == 0
    (row,) = json.loads(out.read_text())
    assert row["size"] == 65536 and row["fill"] == 128 and row["burst"] == 64
    assert row["mean_us"] > 0 and row["p50_us"] > 0 and row["copy_us"] > 0
    assert row["ratio"] == pytest.approx(row["copy_us"] / row["mean_us"], rel=0.01)
    assert row["master_cpu_us"] >= 0 and row["node_cpu_us"] >= 0
    assert "master cpu us" in capsys.readouterr().out


def test_bench_burst_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--burst"):
        run_burst([65536], 8 << 20, burst=0, bursts=1)
    with pytest.raises(ValueError, match="two blocks"):
        run_burst([1 << 20], 1 << 20, burst=8, bursts=1)
