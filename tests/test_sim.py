"""Cluster simulator: determinism, JSON shape, decode epochs, coupled vs disaggregated."""

from __future__ import annotations

import json

import pytest

from kvpool.serve.sched.cost_model import DecodeCostModel
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.decode_engine import DecodeEngine
from kvpool.serve.sched.sim.runner import simulate
from kvpool.workload.cachesim import trace_keys
from kvpool.workload.synth import synthesize
from kvpool.workload.traces import write_trace

KEYS = (
    "requests",
    "completed",
    "rejected",
    "ttft_slo_attainment",
    "tbt_slo_attainment",
    "goodput_rps",
    "mean_ttft_s",
    "hit_ratio",
)


@pytest.fixture(scope="module")
def trace():
    records = synthesize(requests=400, seed=3)
    return records, trace_keys(records)


def run(trace, **kw):
    records, keys = trace
    out = simulate(records, SimConfig(**kw), keys=keys)
    out.pop("sim_wall_s")
    return out


def test_deterministic_and_json_shape(trace) -> None:
    a = run(trace, prefill=3, decode=3, speed=5, router="random", rejection="predicted")
    b = run(trace, prefill=3, decode=3, speed=5, router="random", rejection="predicted")
    assert a == b
    for key in KEYS:
        assert key in a
    assert a["requests"] == 400
    assert a["completed"] + a["rejected"] == 400
    assert 0.0 <= a["hit_ratio"] <= 1.0
    json.dumps(a)


def test_coupled_breaks_tbt_where_disaggregated_does_not(trace) -> None:
    disagg = run(trace, prefill=3, decode=3, speed=8)
    coupled = run(trace, coupled=6, speed=8)
    assert disagg["tbt_slo_attainment"] > coupled["tbt_slo_attainment"] + 0.1
    assert disagg["tbt_slo_attainment"] > 0.95


def test_conductor_beats_random_on_ttft(trace) -> None:
    cond = run(trace, prefill=3, decode=3, speed=8)
    rand = run(trace, prefill=3, decode=3, speed=8, router="random")
    assert cond["mean_ttft_s"] < rand["mean_ttft_s"]
    assert cond["hit_ratio"] > rand["hit_ratio"]


def test_rejection_under_overload(trace) -> None:
    none = run(trace, prefill=6, decode=1, speed=6)
    after = run(trace, prefill=6, decode=1, speed=6, rejection="after")
    pred = run(trace, prefill=6, decode=1, speed=6, rejection="predicted")
    assert none["rejected"] == 0
    assert after["rejected_after_prefill"] > 0 and after["wasted_prefill_s"] > 0
    assert pred["rejected_after_prefill"] == 0 and pred["rejected"] > 0
    assert pred["goodput_rps"] > none["goodput_rps"]


def test_hit_ratio_grows_with_capacity(trace) -> None:
    ratios = [
        run(trace, prefill=3, decode=3, capacity_blocks=c)["hit_ratio"] for c in (0, 16, 4096)
    ]
    assert ratios[0] == 0.0
    assert ratios[0] < ratios[1] < ratios[2]


def test_decode_engine_matches_step_by_step() -> None:
    cost = DecodeCostModel(
        base_s=0.01, per_request_s=0.001, per_token_s=1e-5, kv_capacity_tokens=10**9
    )
    eng = DecodeEngine(cost)
    eng.join(0, context=100, steps=5)
    eng.join(1, context=300, steps=3)
    # brute force: step k with batch b, contexts growing by one per step
    t, ctx, ends = 0.0, {0: 100, 1: 300}, {0: 5, 1: 3}
    times = []
    for _k in range(5):
        live = [r for r in ctx if ends[r] > 0]
        t += 0.01 + 0.001 * len(live) + 1e-5 * sum(ctx[r] for r in live)
        for r in live:
            ctx[r] += 1
            ends[r] -= 1
        times.append(t)
    assert eng.next_wake() == pytest.approx(times[2])
    assert eng.finish_due() == [1]
    eng.leave(300, 0)
    assert eng.tb == pytest.approx(times[2])
    assert eng.next_wake() == pytest.approx(times[4])
    eng.sync(times[3] - 1e-4)  # lands on the boundary after step 3
    assert eng.s == 4 and eng.tb == pytest.approx(times[3])
    assert eng.finish_due() == [0]
    over, first = eng.gaps_over(0, 5, 0.0, slo=1.0)
    assert over == 0 and first == pytest.approx(times[0])


def test_cli_writes_json(tmp_path, trace) -> None:
    from kvpool.cli import main

    path = tmp_path / "t.jsonl"
    write_trace(trace[0][:100], path)
    out = tmp_path / "r.json"
    rc = main(["sim", str(path), "--prefill", "2", "--decode", "2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 100 and set(KEYS) <= set(data)
    assert main(["sim", str(path), "--prefill", "3", "--cpp-group", "2"]) == 1  # not a multiple


def test_sim_report_tables(tmp_path, trace) -> None:
    from kvpool.serve.sched.sim.report import Scenario, markdown, run_all

    path = tmp_path / "t.jsonl"
    write_trace(trace[0][:150], path)
    sc = Scenario(
        speeds_split=(5.0,),
        speeds_router=(5.0,),
        reject=((10, 3, 5.0),),
        reject_both=(4, 2, 8.0, 30.0),
        speed_capacity=5.0,
        capacities=(0, 64),
    )
    res = run_all(str(path), "a800", sc)
    assert [len(res[k]) for k in ("split", "router", "reject", "capacity")] == [3, 4, 8, 4]
    text = markdown(res)
    assert "| speed | cluster |" in text and "coupled 20" in text


def test_decode_engine_stall_counts_one_long_gap() -> None:
    cost = DecodeCostModel(
        base_s=0.01, per_request_s=0.0, per_token_s=0.0, kv_capacity_tokens=10**9
    )
    eng = DecodeEngine(cost)
    eng.join(0, context=10, steps=10)  # first token at t = 0, steps of 10 ms
    end = eng.add_stall(0.035, 0.5)  # a prefill arrives mid step 3: runs at t = 0.04
    assert end == pytest.approx(0.54)
    assert eng.s == 4
    assert eng.next_wake() == pytest.approx(0.54 + 6 * 0.01)
    assert eng.finish_due() == [0]
    over, first = eng.gaps_over(0, 10, 0.0, slo=0.05)
    assert first == pytest.approx(0.01)
    assert over == 1  # the gap of step 4 holds the 0.5 s prefill
    # the coupled request that was prefilled joins after its own stall
    eng2 = DecodeEngine(cost)
    t = eng2.add_stall(0.0, 0.2)
    j = eng2.join(1, context=10, steps=3)
    eng2.finish_due()
    over, first = eng2.gaps_over(j, j + 3, t, slo=0.05)
    assert over == 0 and first == pytest.approx(0.01)
