"""Smoke test of the data-path benchmark (one small size, one round)."""

from __future__ import annotations

from pathlib import Path

from kvpool.bench.remote_transport import run_remote_transport


def test_remote_transport_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    rows = run_remote_transport([64 << 10], ("tcp", "shm"), rounds=1, json_path=str(out))
    kinds = {(r.op, r.tier) for r in rows}
    assert kinds == {
        ("get_into", "tcp"),
        ("put", "tcp"),
        ("get_batch", "tcp"),
        ("get_into", "shm"),
        ("put", "shm"),
    }
    assert all(r.gbps > 0 and r.baseline_gbps > 0 for r in rows)
    assert out.read_text().startswith("[")
