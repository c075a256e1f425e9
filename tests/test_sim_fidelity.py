"""Simulator fidelity: layer-wise KV streaming, hardware presets, goodput as a sustainable rate.

Closed-form cases: each check computes the expected number by hand from the
cost model's constants, then runs the simulator on a trace where nothing
else can move it (one request on an idle cluster).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.serve.sched.cost_model import A800, H100, analytic_cluster, get_hardware
from kvpool.serve.sched.layerwise_model import (
    DEFAULT_LAYER_OVERHEAD_S,
    fit_layer_overhead,
    overhead_from_bench,
    remaining_transfer,
)
from kvpool.serve.sched.sim.cluster import Cluster
from kvpool.serve.sched.sim.config import SimConfig
from kvpool.serve.sched.sim.rate import RateSearch, find_rate, sim_find_rate, trace_rate
from kvpool.workload.cachesim import trace_keys
from kvpool.workload.synth import synthesize
from kvpool.workload.traces import TraceRecord, write_trace

# -- layer-wise overlap: the closed form ----------------------------------------------------


def test_remaining_transfer_closed_forms() -> None:
    # transfer faster than compute: only the last layer's share is left
    assert remaining_transfer(0.8, 1.0, 80) == pytest.approx(0.8 / 80)
    # balanced: still one layer's share
    assert remaining_transfer(1.0, 1.0, 80) == pytest.approx(1.0 / 80)
    # slower: one layer's share plus the excess over compute, less the first layer's compute
    assert remaining_transfer(3.0, 1.0, 80) == pytest.approx(3.0 / 80 + 2.0 * 79 / 80)
    # nothing to overlap with: the whole transfer
    assert remaining_transfer(0.3, 0.0, 80) == pytest.approx(0.3)
    assert remaining_transfer(0.3, 5.0, 1) == pytest.approx(0.3)
    assert remaining_transfer(0.0, 5.0, 80) == 0.0
    # per-layer overhead lengthens the transfer side by L * o
    assert remaining_transfer(0.8, 1.0, 80, 1e-3) == pytest.approx((0.8 + 0.08) / 80)


def test_overhead_fit_recovers_and_matches_the_bench_numbers() -> None:
    c, t, o = 0.030, 0.031, 20e-6
    overlapped = c + remaining_transfer(t, c, 32, o)
    assert fit_layer_overhead(32, c, t, overlapped) == pytest.approx(o, rel=1e-6)
    # bench/RESULTS.md quiet embedded runs (ms): 13.7 and 15.2 us per layer
    assert fit_layer_overhead(32, 27.6e-3, 28.6e-3, 29.9e-3) == pytest.approx(13.7e-6, abs=0.1e-6)
    assert fit_layer_overhead(32, 29.2e-3, 30.3e-3, 31.7e-3) == pytest.approx(15.2e-6, abs=0.1e-6)
    # faster than the formula: no negative overhead
    assert fit_layer_overhead(32, 28.7e-3, 32.9e-3, 33.6e-3) == 0.0
    bench = {"layers": 32, "compute_s": 0.0292, "store_s": 0.0303, "overlapped_s": 0.0317}
    assert overhead_from_bench(bench) == pytest.approx(15.2e-6, abs=0.1e-6)
    with pytest.raises(ValueError, match="missing 'store_s'"):
        overhead_from_bench({"layers": 32, "compute_s": 1.0, "overlapped_s": 1.0})
    with pytest.raises(ValueError, match="at least 2 layers"):
        fit_layer_overhead(1, 1.0, 1.0, 1.0)


def _one_request(input_length: int, output: int = 8) -> list[TraceRecord]:
    return [TraceRecord(0, input_length, output, tuple(range(-(-input_length // 512))))]


def _run_one(records: list[TraceRecord], **kw: object) -> Cluster:
    cfg = SimConfig(prefill=1, decode=1, **kw)  # type: ignore[arg-type]
    cluster = Cluster(records, trace_keys(records, cfg.block_tokens), cfg)
    cluster.run()
    return cluster


@pytest.mark.parametrize("hardware", ["h100", "a800"])
def test_sim_streams_kv_during_prefill(hardware: str) -> None:
    """One 100k-token prompt: the KV is on the decode node the closed form's time after
    the first token (unstreamed: the full transfer)."""
    records = _one_request(100_000)
    streamed = _run_one(records, hardware=hardware)
    full = _run_one(records, hardware=hardware, layerwise=False)
    cost = analytic_cluster("llama2-70b", get_hardware(hardware))
    compute = cost.prefill.predict(100_000, 0)
    transfer = cost.kv_transfer_seconds(100_000)
    assert transfer == pytest.approx(100_000 * 327_680 / 100e9 + 50e-6)  # ~0.33 s
    r, u = streamed.reqs[0], full.reqs[0]
    assert r.first_token == pytest.approx(compute)  # idle cluster: TTFT is the compute
    assert u.ready - u.first_token == pytest.approx(transfer)
    expect = remaining_transfer(transfer, compute, 80, DEFAULT_LAYER_OVERHEAD_S)
    assert r.ready - r.first_token == pytest.approx(expect)
    assert expect == pytest.approx((transfer + 80 * DEFAULT_LAYER_OVERHEAD_S) / 80)  # T < C
    # the request's first inter-token gap shrinks by the hidden transfer
    assert full.results()["mean_tbt_s"] > streamed.results()["mean_tbt_s"]


# -- hardware presets ----------------------------------------------------------------------


def test_a800_preset_closed_forms() -> None:
    assert get_hardware("h100") is H100 and get_hardware("a800") is A800
    with pytest.raises(ValueError, match="unknown hardware preset 'b200'"):
        get_hardware("b200")
    h, a = analytic_cluster("llama2-70b", H100), analytic_cluster("llama2-70b", A800)
    # prefill is compute-bound: 989 / 312 TFLOP/s slower per token
    assert a.prefill.c_token / h.prefill.c_token == pytest.approx(989 / 312)
    assert a.prefill.c_pair / h.prefill.c_pair == pytest.approx(989 / 312)
    # decode is memory-bound: 3.35 / 2.039 TB/s slower per step
    assert a.decode.base_s / h.decode.base_s == pytest.approx(3.35 / 2.039)
    # same 80 GB per GPU, same 100 GB/s of RDMA per node (4 x 200 Gb/s)
    assert a.decode.kv_capacity_tokens == h.decode.kv_capacity_tokens
    assert a.transfer.bandwidth_Bps == pytest.approx(100e9)
    # one prompt on an idle A800 cluster: TTFT is exactly the A800 prefill time
    cluster = _run_one(_one_request(8192), hardware="a800")
    assert cluster.reqs[0].first_token == pytest.approx(a.prefill.predict(8192, 0))
    assert cluster.results()["config"]["hardware"] == "a800"
    with pytest.raises(ValueError, match="unknown hardware preset"):
        SimConfig(hardware="b200").validate()


# -- goodput as a sustainable rate ---------------------------------------------------------


def test_find_rate_brackets_the_threshold() -> None:
    calls: list[float] = []

    def run_at(speed: float) -> dict[str, float]:
        calls.append(speed)
        ok = 1.0 if speed <= 3.3 else 0.5
        return {"slo_attainment_all": ok, "goodput_rps": speed * ok}

    out = find_rate(run_at, 2.0, 1.0, RateSearch(rel_tol=0.02))
    assert 3.3 / 1.02 <= out["sustainable_speed"] <= 3.3
    assert out["sustainable_rps"] == pytest.approx(2.0 * out["sustainable_speed"])
    assert len(calls) == len(set(calls)) <= 12
    # starting above: halves down first; nothing sustainable at all: 0
    down = find_rate(run_at, 2.0, 100.0, RateSearch(rel_tol=0.02))
    assert 3.3 / 1.02 <= down["sustainable_speed"] <= 3.3
    never = find_rate(
        lambda s: {"slo_attainment_all": 0.0, "goodput_rps": 0.0},
        1.0,
        1.0,
        RateSearch(speed_bounds=(0.25, 4.0)),
    )
    assert never["sustainable_rps"] == 0.0 and never["at_sustainable"] is None
    with pytest.raises(ValueError, match="attainment"):
        find_rate(run_at, 1.0, 1.0, RateSearch(attainment=0.0))
    with pytest.raises(ValueError, match="at least 2 requests"):
        trace_rate(_one_request(600))


def test_sim_find_rate_holds_below_and_fails_above() -> None:
    records = synthesize(requests=300, seed=5)
    keys = trace_keys(records)
    out = sim_find_rate(records, SimConfig(prefill=2, decode=2), RateSearch(), keys=keys)
    s = out["sustainable_speed"]
    assert s > 0 and out["at_sustainable"]["slo_attainment_all"] >= 0.9
    above = [p for p in out["rate_search"] if p["speed"] > s]
    assert above and all(p["slo_attainment_all"] < 0.9 for p in above[:1])
    assert above[0]["speed"] <= s * 1.05 + 1e-9  # bracketed within the tolerance
    assert out["sustainable_rps"] == pytest.approx(s * trace_rate(records))


def test_sim_cli_find_rate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(synthesize(requests=200, seed=2), str(trace))
    out = tmp_path / "r.json"
    argv = ["sim", str(trace), "--prefill", "2", "--decode", "2", "--hardware", "a800"]
    rc = main([*argv, "--find-rate", "--attainment", "0.8", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    for key in ("goodput_rps", "tbt_slo_attainment", "sustainable_rps", "sustainable_speed"):
        assert isinstance(d[key], float)
    assert d["attainment_target"] == 0.8 and d["config"]["hardware"] == "a800"
    assert d["config"]["speed"] == 1.0  # the main result stays at --speed
    capsys.readouterr()
    bench = tmp_path / "lw.json"
    bench.write_text(
        json.dumps({"layers": 32, "compute_s": 0.03, "store_s": 0.03, "overlapped_s": 0.032})
    )
    assert main([*argv, "--layerwise-calibration", str(bench), "--json", str(out)]) == 0
    fitted = json.loads(out.read_text())["config"]["layer_overhead_s"]
    assert fitted == pytest.approx(fit_layer_overhead(32, 0.03, 0.03, 0.032))


def test_sim_cli_bad_fidelity_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(synthesize(requests=20, seed=2), str(trace))
    argv = ["sim", str(trace), "--prefill", "1", "--decode", "1"]
    with pytest.raises(SystemExit):  # a usage error (kvpool.args.seconds_arg)
        main([*argv, "--load-series", str(tmp_path / "s.json"), "--load-interval", "0"])
    assert "--load-interval: expected a positive number of seconds" in capsys.readouterr().err
    bad = tmp_path / "lw.json"
    bad.write_text(json.dumps({"layers": 32}))
    assert main([*argv, "--layerwise-calibration", str(bad)]) == 1
    assert "not a kvpool bench layerwise result: missing 'compute_s'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--find-rate", "--attainment", "1.5"])
    assert "--attainment: expected a share from 0 to 1" in capsys.readouterr().err
    assert main([*argv, "--find-rate", "--attainment", "0"]) == 1
    assert "attainment must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--hardware", "b200"])
