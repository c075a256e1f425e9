"""Smoke test of ``kvpool bench remote``: tiny sizes, one round, shm and tcp."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpool.bench.remote import register_remote

KEYS = {"op", "transport", "size", "gbps", "baseline", "baseline_gbps", "ratio", "p50_us", "p99_us"}
OPS = ("put", "get_into", "get_into_leased", "put_batch", "get_into_batch")


def test_bench_remote_json_shape(tmp_path: Path, capsys: object) -> None:
    parser = argparse.ArgumentParser()
    register_remote(parser.add_subparsers(dest="suite"))  # the suite's own CLI arguments
    out = tmp_path / "rows.json"
    argv = ["remote", "--sizes", "64KiB", "--transport", "shm,tcp", "--rounds", "1", "--batch", "4"]
    args = parser.parse_args([*argv, "--working-set", "1MiB", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert isinstance(rows, list)
    assert {(r["op"], r["transport"]) for r in rows} == {
        (o, t) for o in OPS for t in ("shm", "tcp")
    }
    for row in rows:
        assert set(row) >= KEYS
        assert row["size"] == 64 << 10 and row["store"] == "kvpool"
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0 and row["ratio"] > 0
        assert row["p99_us"] >= row["p50_us"] > 0
        kind = "numpy copy" if row["transport"] == "shm" else "raw socket"
        assert row["baseline"].startswith(kind)
        assert row["batch"] == (4 if row["op"].endswith("_batch") else 1)
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "get_into_batch" in printed and "numpy copy" in printed
    assert "CPU steal during the run: " in printed  # /proc/stat is there on Linux
