"""``kvpool bench hot`` at a tiny size: both modes run and replication really happens."""

from __future__ import annotations

from kvpool.bench.hot import run_hot


def test_hot_bench_shape_and_replication() -> None:
    off, on = run_hot(nodes=2, readers=2, blocks=2, size=256 << 10, seconds=1.0, transport="tcp")
    assert (off.replication, on.replication) == ("off", "on")
    assert off.replicas_per_block == 1.0
    assert on.replicas_per_block > 1.0
    assert off.gbps > 0 and on.gbps > 0 and off.reads > 0 and on.p99_us >= on.p50_us
