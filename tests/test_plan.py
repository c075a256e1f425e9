"""kvpool plan: split search, coupled baseline, smallest cluster, pool sizing, JSON + PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.workload.synth import synthesize
from kvpool.workload.traces import write_trace


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("plan") / "trace.jsonl"
    write_trace(synthesize(requests=300, seed=11), str(path))
    return str(path)


def test_plan_cli_json_and_plot(trace_file: str, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            trace_file,
            "--nodes",
            "6",
            "--speed",
            "6",
            "--cpp-groups",
            "1,2",
            "--max-nodes",
            "16",
            "--policies",
            "lru,s3fifo",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "best split" in text and "coupled baseline" in text and "smallest cluster" in text
    d = json.loads(out.read_text())
    assert set(d["best"]) == {
        "prefill",
        "decode",
        "cpp_group",
        "goodput_rps",
        "sustainable_rps",
        "sustainable_rps_per_node",
    }
    curve = d["curve"]
    assert [p["prefill"] for p in curve] == [1, 2, 3, 4, 5]
    for p in curve:
        assert p["prefill"] + p["decode"] == 6
        assert p["cpp_group"] in (1, 2) and p["prefill"] % p["cpp_group"] == 0
        for k in ("goodput_rps", "ttft_slo_attainment", "tbt_slo_attainment", "sustainable_rps"):
            assert isinstance(p[k], float)
        assert p["sustainable_rps_per_node"] == pytest.approx(p["sustainable_rps"] / 6)
    # ranked by the sustainable rate (DistServe goodput), not goodput at --speed
    assert d["best"]["sustainable_rps"] == max(p["sustainable_rps"] for p in curve)
    assert isinstance(d["coupled_goodput_rps"], float)
    assert isinstance(d["coupled_sustainable_rps"], float)
    assert "sustains" in text
    sc = d["smallest_cluster"]
    assert sc is None or (2 <= sc["nodes"] <= 16 and sc["slo_attainment_all"] >= 0.9)
    rows = d["pool_sizing"]
    assert {r["policy"] for r in rows} == {"lru", "s3fifo"}
    lru = [r for r in rows if r["policy"] == "lru" and r["ssd_blocks"] == 0]
    hits = [r["hit_ratio"] for r in sorted(lru, key=lambda r: r["dram_blocks"])]
    assert hits == sorted(hits) and 0 < hits[-1] <= 1  # more DRAM, more hits
    for r in rows:
        assert r["hit_ratio"] >= r["dram_hit_ratio"] - 1e-12  # SSD only adds
        assert 0 <= r["saved_prefill_fraction"] <= 1
    png = tmp_path / "plan.png"
    pytest.importorskip("matplotlib")
    assert png.exists() and png.stat().st_size > 1000


def test_smallest_cluster_is_minimal(trace_file: str) -> None:
    from kvpool.serve.sched.plan import Planner
    from kvpool.serve.sched.sim.config import SimConfig
    from kvpool.workload.traces import load_trace

    planner = Planner(load_trace(trace_file), SimConfig(), [1])
    sc = planner.smallest_cluster(6.0, 0.9, 16)
    assert sc is not None
    n = sc["nodes"]
    if n > 2:
        assert planner.best_split(n - 1, 6.0)["slo_attainment_all"] < 0.9
