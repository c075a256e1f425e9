"""Cache simulator: exact hit ratios on a hand-made trace, oracle bounds, CLI shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.eviction import ONLINE_POLICIES, BeladyPolicy, make_policy
from kvpool.workload.cachesim import infinite_hits, run_cachesim, simulate, trace_keys
from kvpool.workload.synth import synthesize
from kvpool.workload.traces import TraceRecord, write_trace

B = 512


def rec(ids: list[int], tail: int = B) -> TraceRecord:
    return TraceRecord(0, (len(ids) - 1) * B + tail, 1, tuple(ids))


# 12 full blocks in all; block "2" after "9" is a different key (other prefix).
HAND = [rec([1, 2, 3]), rec([1, 2, 4]), rec([1, 2, 3, 5]), rec([9, 2])]


@pytest.fixture(scope="module")
def hand_keys() -> list[list[bytes]]:
    return trace_keys(HAND)


def test_keys_come_from_the_index(hand_keys: list[list[bytes]]) -> None:
    assert [len(k) for k in hand_keys] == [3, 3, 4, 2]
    assert hand_keys[0][:2] == hand_keys[1][:2] == hand_keys[2][:2]
    assert hand_keys[0][2] == hand_keys[2][2] != hand_keys[1][2]
    assert hand_keys[3][1] != hand_keys[0][1]
    # a partial tail block gets no key
    assert len(trace_keys([rec([1, 2, 3], tail=100)])[0]) == 2


def test_exact_hit_counts(hand_keys: list[list[bytes]]) -> None:
    assert infinite_hits(hand_keys) == (5, 12)
    # LRU, 3 blocks: r1 hits 1,2; r2 hits 1,2 (3 was evicted for 4); r3 misses.
    assert simulate(hand_keys, make_policy("lru"), 3) == (4, 12)
    # LRU, 2 blocks: every request finds its first block evicted.
    assert simulate(hand_keys, make_policy("lru"), 2) == (0, 12)
    assert simulate(hand_keys, make_policy("leaf"), 3) == (4, 12)
    # Belady keeps 1,2,3 and bypasses 4, 5: r1 hits 2, r2 hits 3.
    assert simulate(hand_keys, BeladyPolicy(hand_keys, 3), 3) == (5, 12)
    # With room for 2 it keeps 1,2 and bypasses 3 (next use later than theirs).
    assert simulate(hand_keys, BeladyPolicy(hand_keys, 2), 2) == (4, 12)
    assert simulate(hand_keys, make_policy("lru"), 0) == (0, 12)


def test_hits_stop_at_first_miss() -> None:
    keys = trace_keys([rec([1, 2, 3]), rec([1, 2, 3])])
    p = make_policy("lru")
    for parent, key in zip([None, *keys[0][:-1]], keys[0], strict=True):
        p.on_insert(key, parent)
    p.on_remove(keys[0][0])  # blocks 2 and 3 stay, but the prefix is broken
    assert simulate(keys[1:], p, 10) == (0, 3)


def test_admission_filter_in_the_simulator() -> None:
    keys = trace_keys([rec([1, 2]), rec([1, 2]), rec([1, 2])])
    # first sight refused, second admitted, third hits
    assert simulate(keys, make_policy("lru+admit2"), 10) == (2, 6)


def test_belady_bounds_online_policies() -> None:
    keys = trace_keys(synthesize(requests=400, seed=5))
    unique = len({k for ks in keys for k in ks})
    rows = run_cachesim(keys, [unique // 20, unique // 10], ONLINE_POLICIES)
    inf = [r for r in rows if r["policy"] == "infinite"]
    assert len(inf) == 1 and inf[0]["capacity_blocks"] is None
    belady = {r["capacity_blocks"]: r["hit_ratio"] for r in rows if r["policy"] == "belady"}
    assert len(belady) == 2
    for r in rows:
        assert 0.0 <= r["hit_ratio"] <= inf[0]["hit_ratio"] + 1e-12
        if r["policy"] not in ("belady", "infinite"):
            assert r["hit_ratio"] <= belady[r["capacity_blocks"]] + 1e-12, r
    assert belady[unique // 10] >= belady[unique // 20]


def test_cachesim_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "hand.jsonl"
    write_trace(HAND, trace)
    out = tmp_path / "rows.json"
    argv = ["cachesim", str(trace), "--capacity-blocks", "2,3", "--policy", "lru,leaf"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "infinite capacity: 0.4167" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert all(set(r) == {"policy", "capacity_blocks", "hit_ratio"} for r in rows)
    got = {(r["policy"], r["capacity_blocks"]): r["hit_ratio"] for r in rows}
    assert got == {
        ("lru", 2): 0.0,
        ("lru", 3): 4 / 12,
        ("leaf", 2): got[("leaf", 2)],
        ("leaf", 3): 4 / 12,
        ("belady", 2): 4 / 12,
        ("belady", 3): 5 / 12,
        ("infinite", None): 5 / 12,
    }
    # default: every online policy, plus belady and infinite
    assert main(["cachesim", str(trace), "--capacity-blocks", "3", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == [*ONLINE_POLICIES, "belady", "infinite"]


def test_cachesim_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    assert main(["cachesim", str(trace), "--capacity-blocks", "3"]) == 2
    assert "line 1" in capsys.readouterr().err
    write_trace(HAND, trace)
    assert main(["cachesim", str(trace), "--policy", "nope"]) == 2
    assert "unknown policy nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cachesim", str(trace), "--capacity-blocks", "a,b"])


def test_bench_chain_keys_share_exactly_like_the_index() -> None:
    from kvpool.bench.policy_cost import chain_keys

    recs = synthesize(requests=300, seed=2)
    fast, real = chain_keys(recs), trace_keys(recs)
    assert [len(k) for k in fast] == [len(k) for k in real]
    for cap in (50, 400):
        for name in ("lru", "leaf-s3"):
            assert simulate(fast, make_policy(name), cap) == simulate(real, make_policy(name), cap)
