"""Keep-for-H bound (kvpool.eviction.horizon): exact values by hand, invariants, CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.eviction.horizon import keep_for_h_bound, keep_for_h_points, use_gaps
from kvpool.workload.cachesim import infinite_hits, trace_keys
from kvpool.workload.synth import synthesize
from kvpool.workload.traces import TraceRecord, write_trace

# Chained keys (a key spells its whole prefix), 9 blocks, times in seconds.
HAND = [[b"A", b"AB"], [b"A", b"AC"], [b"A", b"AB", b"ABD"], [b"A", b"AC"]]
TIMES = [0.0, 1.0, 3.0, 10.0]


def test_gaps_by_hand() -> None:
    gaps, tails = use_gaps(HAND, TIMES)
    # A: 0->1->3->10; AB: 0->3; AC: 1->10; last uses end 10, 7, 0, 7 s before the end.
    assert sorted(gaps) == [1, 2, 3, 7, 9]
    assert sorted(tails) == [0, 0, 7, 7]
    assert infinite_hits(HAND) == (5, 9)  # every gap is a hit at infinite capacity


def flat(points: list[tuple[float, int]]) -> list[float]:
    return [v for point in points for v in point]


def test_points_by_hand() -> None:
    gaps, tails = use_gaps(HAND, TIMES)
    # block-seconds sum(min(gap, H)) over 10 s; H = 0, 1, 2, 3, 7, 9, inf
    oracle = keep_for_h_points(gaps, tails, 10.0, reuse_oracle=True)
    assert flat(oracle) == pytest.approx(
        flat([(0, 0), (0.5, 1), (0.9, 2), (1.2, 3), (2.0, 4), (2.2, 5), (2.2, 5)])
    )
    # plus the last uses, kept min(H, time to the end): 0, 2, 4, 6, 14, 14, 14
    plain = keep_for_h_points(gaps, tails, 10.0, reuse_oracle=False)
    assert flat(plain) == pytest.approx(
        flat([(0, 0), (0.7, 1), (1.3, 2), (1.8, 3), (3.4, 4), (3.6, 5), (3.6, 5)])
    )


def test_bound_by_hand() -> None:
    # oracle hull: (0,0) -> (1.2, 3) [H=3] -> (2.2, 5) [H=9], flat after
    got = keep_for_h_bound(HAND, TIMES, [0, 1, 2, 3, 100], reuse_oracle=True)
    assert got == pytest.approx([0, 2.5 / 9, 4.6 / 9, 5 / 9, 5 / 9])
    # plain hull: (0,0) -> (1.8, 3) [H=3] -> (3.6, 5) [H=9]
    got = keep_for_h_bound(HAND, TIMES, [0, 1, 2, 3, 4], reuse_oracle=False)
    assert got == pytest.approx([0, 5 / 27, 29 / 81, 13 / 27, 5 / 9])
    # default: no oracle
    assert keep_for_h_bound(HAND, TIMES, [2]) == pytest.approx([29 / 81])


def test_degenerate_traces() -> None:
    assert keep_for_h_bound([], [], [0, 5]) == [0.0, 0.0]
    assert keep_for_h_bound([[]], [1.0], [5]) == [0.0]
    # one instant: every reuse costs no block-seconds, any room gets them all
    same = [[b"A"], [b"A", b"AB"], [b"A", b"AB"]]
    assert keep_for_h_bound(same, [2.0, 2.0, 2.0], [0, 1]) == [0.0, 3 / 5]


@pytest.fixture(scope="module")
def synth() -> tuple[list[list[bytes]], list[float]]:
    recs = synthesize(requests=400, seed=3)
    return trace_keys(recs), [r.timestamp / 1000 for r in recs]


def test_invariants(synth: tuple[list[list[bytes]], list[float]]) -> None:
    reqs, ts = synth
    unique = len({k for keys in reqs for k in keys})
    caps = sorted({0, 1, 5, 20, 50, unique // 20, unique // 10, unique // 2, unique, 10 * unique})
    inf_hits, total = infinite_hits(reqs)
    inf = inf_hits / total
    plain = keep_for_h_bound(reqs, ts, caps)
    oracle = keep_for_h_bound(reqs, ts, caps, reuse_oracle=True)
    assert plain[0] == oracle[0] == 0.0
    for series in (plain, oracle):
        assert all(a <= b for a, b in itertools.pairwise(series))
        assert all(0 <= v <= inf + 1e-12 for v in series)
    assert all(p <= o + 1e-12 for p, o in zip(plain, oracle, strict=True))
    # enough room for every reused block at once: the infinite ratio exactly
    assert oracle[-1] == pytest.approx(inf)
    assert plain[-1] == pytest.approx(inf)


def test_hull_matches_brute_force(synth: tuple[list[list[bytes]], list[float]]) -> None:
    reqs, ts = synth
    reqs, ts = reqs[:60], ts[:60]
    total = sum(len(k) for k in reqs)
    gaps, tails = use_gaps(reqs, ts)
    for oracle in (False, True):
        pts = [(0.0, 0), *keep_for_h_points(gaps, tails, ts[-1] - ts[0], oracle)]
        for cap in (1, 3, 10, 30, 100, 1000):
            best = max(h for o, h in pts if o <= cap)
            for (o1, h1), (o2, h2) in itertools.combinations(pts, 2):
                if o1 < cap < o2:  # mix shares of the two
                    best = max(best, h1 + (h2 - h1) * (cap - o1) / (o2 - o1))
                elif o2 < cap < o1:
                    best = max(best, h2 + (h1 - h2) * (cap - o2) / (o1 - o2))
            assert keep_for_h_bound(reqs, ts, [cap], oracle)[0] == pytest.approx(best / total)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"differ in length \(4 != 3\)"):
        keep_for_h_bound(HAND, TIMES[:3], [1])
    with pytest.raises(ValueError, match="capacities must be >= 0, got -1"):
        keep_for_h_bound(HAND, TIMES, [1, -1])
    with pytest.raises(ValueError, match=r"must be sorted.*\[2\] = 0.5 < \[1\] = 1.0"):
        keep_for_h_bound(HAND, [0.0, 1.0, 0.5, 2.0], [1])
    with pytest.raises(ValueError, match="not finite"):
        keep_for_h_bound(HAND, [0.0, 1.0, float("nan"), 2.0], [1])


def test_cli_bound_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = 512
    # the hand trace as records: system block 1, then branches (ms timestamps)
    recs = [
        TraceRecord(0, 2 * b, 1, (1, 2)),
        TraceRecord(1000, 2 * b, 1, (1, 3)),
        TraceRecord(3000, 3 * b, 1, (1, 2, 4)),
        TraceRecord(10000, 2 * b, 1, (1, 3)),
    ]
    trace = tmp_path / "hand.jsonl"
    write_trace(recs, trace)
    argv = ["cachesim", str(trace), "--capacity-blocks", "1,2", "--policy", "lru"]
    assert main([*argv, "--bound", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(set(r) == {"policy", "capacity_blocks", "hit_ratio"} for r in rows)
    assert [r["policy"] for r in rows] == [
        "lru",
        "lru",
        "belady",
        "belady",
        "keep-for-h",
        "keep-for-h",
        "keep-for-h+oracle",
        "keep-for-h+oracle",
        "infinite",
    ]
    got = {(r["policy"], r["capacity_blocks"]): r["hit_ratio"] for r in rows}
    assert got[("keep-for-h", 2)] == pytest.approx(29 / 81)
    assert got[("keep-for-h+oracle", 1)] == pytest.approx(2.5 / 9)
    assert main([*argv, "--bound"]) == 0
    out = capsys.readouterr().out
    assert "keep-for-h+oracle" in out and "infinite capacity: 0.5556" in out
    # without the flag: no bound rows
    assert main([*argv, "--json", "-"]) == 0
    assert "keep-for-h" not in capsys.readouterr().out
    # unsorted timestamps: a clear error
    write_trace([recs[1], recs[0]], trace)
    assert main([*argv, "--bound"]) == 2
    assert "--bound: timestamps_s must be sorted" in capsys.readouterr().err
