"""Cost model: the fit recovers known coefficients; JSON round trip; a tiny real calibration."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpool.serve.sched.cost_model import (
    PrefillCostModel,
    analytic_cluster,
    attention_pairs,
    fit_prefill,
    grid,
)


def test_fit_recovers_known_coefficients() -> None:
    truth = PrefillCostModel(c0=0.004, c_token=2e-5, c_pair=3e-9, c_cached=1e-6)
    rng = np.random.default_rng(0)
    samples = []
    for n in grid(8192, 8, 64):
        for frac in (0.0, 0.25, 0.5, 0.75):
            cached = int(n * frac) // 64 * 64
            t = truth.predict(n - cached, cached) * (1 + 0.01 * rng.standard_normal())
            samples.append((n - cached, cached, t))
    fit = fit_prefill(samples)
    for got, want in zip(fit.coefficients(), truth.coefficients(), strict=True):
        assert got == pytest.approx(want, rel=0.1, abs=2e-4 * want + 1e-12)
    assert fit.meta["mean_rel_error"] < 0.02


def test_fit_is_non_negative_and_skips_constant_features() -> None:
    # linear timings, no cached samples: c_pair and c_cached stay 0, none negative
    samples = [(n, 0, 0.001 + 1e-5 * n) for n in (100, 200, 400, 800)]
    fit = fit_prefill(samples)
    assert fit.c_cached == 0.0
    assert min(fit.coefficients()) >= 0.0
    assert fit.predict(1000, 0) == pytest.approx(0.011, rel=0.02)
    with pytest.raises(ValueError):
        fit_prefill([(1, 0, 1.0)])


def test_json_round_trip(tmp_path) -> None:
    m = PrefillCostModel(0.1, 0.2, 0.3, 0.4, model="tiny", source="t", meta={"x": 1})
    p = tmp_path / "m.json"
    m.save(p)
    assert PrefillCostModel.load(p) == m
    # a calibration file nests the model under "prefill"
    p.write_text(json.dumps({"prefill": m.to_dict(), "samples": []}))
    assert PrefillCostModel.load(p) == m


def test_attention_pairs_match_preset_flops() -> None:
    cm = analytic_cluster("llama2-70b")
    cfg = cm.config
    flops = cm.hardware.gpus * cm.hardware.peak_flops * cm.hardware.mfu
    for new, cached in ((512, 0), (4096, 2048), (8000, 512)):
        want = cfg.prefill_flops(new, cached) / flops + cm.prefill.c0
        assert cm.prefill.predict(new, cached) == pytest.approx(want, rel=1e-9)
    assert attention_pairs(3, 2) == 3 * 2 + 6
    # the decode step is memory-bound: ~140 GB of weights over 8 x 3.35 TB/s x 0.7
    assert 0.005 < cm.decode.unloaded_tbt(4096) < 0.01
    assert cm.decode.kv_capacity_tokens > 1_000_000


def test_calibrate_tiny_end_to_end(tmp_path) -> None:
    pytest.importorskip("torch")
    from kvpool.cli import main

    out = tmp_path / "cm.json"
    rc = main(
        [
            "calibrate",
            "--model",
            "tiny",
            "--max-tokens",
            "512",
            "--points",
            "2",
            "--repeats",
            "1",
            "--block-tokens",
            "64",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    model = PrefillCostModel.load(out)
    assert model.model == "tiny" and len(data["samples"]) >= 6
    assert data["transfer"]["bandwidth_Bps"] > 0
    assert model.predict(512, 0) > 0
