"""Pipeline prefill (CPP) in the simulator: time model, TP comparison, cluster hook."""

from __future__ import annotations

import pytest

from kvpool.serve.sched.cost_model import analytic_cluster
from kvpool.serve.sched.pipeline_model import (
    CHUNK_OVERHEAD_S,
    cpp_seconds,
    pipeline_seconds,
    tp_seconds,
    ttft_curve,
)
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.cpp import CppCluster
from kvpool.serve.sched.sim.runner import simulate
from kvpool.workload.cachesim import trace_keys
from kvpool.workload.synth import synthesize

COST = analytic_cluster("llama2-70b")


def test_one_stage_one_chunk_is_the_single_node_model() -> None:
    s, bubble = pipeline_seconds(COST, 8192, 0, 1, 8192)
    assert s == pytest.approx(COST.prefill.predict(8192, 0) + CHUNK_OVERHEAD_S)
    assert bubble == pytest.approx(0.0)


def test_cpp_beats_cross_node_tp_and_approaches_k() -> None:
    rows = {r["tokens"]: r for r in ttft_curve(COST)}
    long = rows[131072]
    assert 1.8 < long["single_s"] / long["cpp2_s"] < 2.0
    assert 3.4 < long["single_s"] / long["cpp4_s"] < 4.0
    for r in rows.values():
        assert r["cpp2_s"] < r["tp2_s"] and r["cpp4_s"] < r["tp4_s"]
        assert r["cpp2_s"] < r["single_s"]
    # the bubble shrinks as the prompt grows (more chunks per fill/drain)
    assert rows[8192]["cpp4_bubble"] > rows[131072]["cpp4_bubble"]
    # TP over 2 nodes loses to one node at 8k: the all-reduces cost more than half the compute
    assert rows[8192]["tp2_s"] > rows[8192]["single_s"]
    assert tp_seconds(COST, 8192, 0, 1) == pytest.approx(COST.prefill.predict(8192, 0))


def test_best_chunk_is_no_worse_than_any_candidate() -> None:
    s, _b, chunk = cpp_seconds(COST, 40000, 4096, 2)
    for c in (1024, 4096, 16384):
        assert s <= pipeline_seconds(COST, 40000, 4096, 2, c)[0] + 1e-12
    assert chunk in (1024, 2048, 4096, 8192, 16384)


def test_sim_cpp_group_pipelines_long_prompts() -> None:
    records = synthesize(requests=300, seed=5)
    keys = trace_keys(records)
    base = simulate(records, SimConfig(prefill=4, decode=4, speed=4), keys=keys)
    cfg = SimConfig(prefill=4, decode=4, speed=4, cpp_group=2)
    cpp = simulate(records, cfg, keys=keys)
    assert cpp["config"]["cpp_group"] == 2 and "cpp_requests" in cpp
    forced = CppCluster(records, keys, cfg, min_tokens=1).run()
    assert forced["cpp_requests"] > 0
    assert forced["completed"] == base["completed"]
    with pytest.raises(ValueError, match="multiple"):
        simulate(records, SimConfig(prefill=3, decode=4, cpp_group=2), keys=keys)
    with pytest.raises(ValueError, match="coupled"):
        simulate(records, SimConfig(coupled=4, cpp_group=2), keys=keys)


def test_choose_pipeline_rule() -> None:
    from kvpool.serve.sched.pipeline_model import choose_pipeline

    assert not choose_pipeline(1.0, 0.5, 2.0, 1000, 16384)  # fits: never split
    assert choose_pipeline(3.0, 2.0, 2.0, 1000, 16384)  # misses the SLO, group faster
    assert not choose_pipeline(3.0, 3.5, 2.0, 1000, 16384)  # group not faster
    assert choose_pipeline(1.0, 0.6, 2.0, 20000, 16384)  # long: pipeline when faster
