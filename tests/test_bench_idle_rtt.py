"""Smoke test of ``kvpool bench idle-rtt``: two gaps, a few samples, JSON shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpool.bench.idle_rtt import raw_wake_us, register_idle_rtt, run_idle_rtt


def test_bench_idle_rtt_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    register_idle_rtt(parser.add_subparsers(dest="suite"))
    out = tmp_path / "rows.json"
    args = parser.parse_args(["idle-rtt", "--idle-ms", "0,1", "--samples", "3", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert [r["idle_ms"] for r in rows] == [0.0, 1.0]
    for row in rows:
        assert row["master_rtt_us"] > 0 and row["raw_rtt_us"] > 0
        assert row["ratio"] == pytest.approx(row["master_rtt_us"] / row["raw_rtt_us"])
    assert "master µs" in capsys.readouterr().out


def test_bench_idle_rtt_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="samples"):
        run_idle_rtt([0.0], samples=0)
    with pytest.raises(ValueError, match="idle"):
        run_idle_rtt([-1.0], samples=3)


def test_raw_wake_us_names_each_gap() -> None:
    """``bench all``'s hand-off fact: a p50 per idle gap, keyed by the gap in ms."""
    got = raw_wake_us((0.0, 1.5), samples=3)
    assert list(got) == ["0", "1.5"] and all(us > 0 for us in got.values())
