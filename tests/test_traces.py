"""Trace I/O, validation, token synthesis and the synthetic generator."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cli import main
from kvpool.index.keys import Namespace, block_keys
from kvpool.workload.synth import SynthConfig, synthesize
from kvpool.workload.tokens import block_tokens_for_ids, tokens_for_request
from kvpool.workload.traces import TraceError, TraceRecord, load_trace, write_trace

NS = Namespace(model="trace-test")
GOOD = (
    '{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
    '"hash_ids": [46,47,48,49,50,51,52,53,54,55,56,57,2353,2354]}'
)


def test_load_example_and_roundtrip(tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    src.write_text(GOOD + "\n\n" + GOOD.replace("27482", "30535") + "\n")
    recs = load_trace(src)
    assert len(recs) == 2
    assert recs[0] == TraceRecord(27482, 6955, 52, tuple([*range(46, 58), 2353, 2354]))
    out = tmp_path / "o.jsonl"
    assert write_trace(recs, out) == 2
    assert load_trace(out) == recs
    assert json.loads(out.read_text().splitlines()[0]) == json.loads(GOOD)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "missing field(s) 'hash_ids'"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        (
            '{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": [1]}',
            "input_length",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1.5, "hash_ids": [1]}',
            "output_length",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": 7}',
            "list of integers",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1, "x"]}',
            "'hash_ids'[1]",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [true]}',
            "'hash_ids'[0]",
        ),
        (
            '{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
            "needs 2 block id",
        ),
    ],
)
def test_load_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(GOOD + "\n" + GOOD + "\n" + line + "\n" + GOOD + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(src)
    assert err.value.line == 3
    assert "line 3: " in str(err.value) and message in str(err.value)
    assert str(src) in str(err.value)


def test_block_count_check_can_be_disabled() -> None:
    text = '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2, 3]}\n'
    assert load_trace(io.StringIO(text), block_tokens=None)[0].hash_ids == (1, 2, 3)
    assert load_trace(io.StringIO(text), block_tokens=400)[0].input_length == 1000


def test_tokens_are_deterministic_per_id_and_cut() -> None:
    rec = TraceRecord(0, 700, 1, (5, 9))
    toks = tokens_for_request(rec)
    assert toks.dtype == np.int32 and toks.shape == (700,)
    assert int(toks.min()) >= 0 and int(toks.max()) < 32000
    blocks = block_tokens_for_ids([9, 5, 5])
    assert np.array_equal(blocks[1], blocks[2])
    assert np.array_equal(toks[:512], blocks[1]) and np.array_equal(toks[512:], blocks[0][:188])
    assert not np.array_equal(blocks[0], blocks[1])
    big = block_tokens_for_ids([2**64 - 1, 2**64 - 2], block_tokens=8, vocab_size=300)
    assert not np.array_equal(big[0], big[1]) and int(big.max()) < 300
    with pytest.raises(ValueError, match="exceeds"):
        tokens_for_request(
            {"timestamp": 0, "input_length": 2000, "output_length": 0, "hash_ids": [1]}
        )
    assert tokens_for_request(TraceRecord(0, 0, 0, ())).size == 0


@settings(max_examples=60, deadline=None)
@given(
    shared=st.lists(st.integers(0, 2**40), max_size=5),
    a=st.lists(st.integers(0, 2**40), min_size=1, max_size=4),
    b=st.lists(st.integers(0, 2**40), min_size=1, max_size=4),
    tail_a=st.integers(1, 16),
    tail_b=st.integers(1, 16),
)
def test_shared_leading_ids_give_exactly_shared_keys(
    shared: list[int], a: list[int], b: list[int], tail_a: int, tail_b: int
) -> None:
    bt = 16
    if a[0] == b[0]:
        b[0] = a[0] + 1
    ids_a, ids_b = shared + a, shared + b
    rec_a = TraceRecord(0, (len(ids_a) - 1) * bt + tail_a, 1, tuple(ids_a))
    rec_b = TraceRecord(0, (len(ids_b) - 1) * bt + tail_b, 1, tuple(ids_b))
    ka = block_keys(tokens_for_request(rec_a, bt), NS, bt)
    kb = block_keys(tokens_for_request(rec_b, bt), NS, bt)
    assert len(ka) == rec_a.input_length // bt
    common = 0
    while common < min(len(ka), len(kb)) and ka[common] == kb[common]:
        common += 1
    full = min(len(ka), len(kb))
    assert common == min(len(shared), full)


def test_synth_is_deterministic_and_seeded() -> None:
    a = synthesize(requests=300, seed=7)
    b = synthesize(SynthConfig(requests=300, seed=7))
    c = synthesize(requests=300, seed=8)
    assert a == b and a != c
    assert len(a) == 300
    ts = [r.timestamp for r in a]
    assert ts == sorted(ts)
    for r in a:  # valid records: ids match the length in 512-token blocks
        assert len(r.hash_ids) == -(-r.input_length // 512)


def test_synth_structure() -> None:
    cfg = SynthConfig(requests=1500, seed=3)
    recs = synthesize(cfg)
    # Multi-turn sessions: a later prompt = earlier prompt + its reply + a new turn,
    # sharing every full block of the earlier prompt.
    by_prefix: dict[tuple[int, ...], list[TraceRecord]] = {}
    for r in recs:
        by_prefix.setdefault(r.hash_ids[:1], []).append(r)
    extended = 0
    latest: dict[tuple[int, ...], TraceRecord] = {}
    for r in recs:
        full = r.input_length // 512
        for j in range(full, 0, -1):
            prev = latest.get(r.hash_ids[:j])
            if prev is not None and len(prev.hash_ids) == j + 1:
                if r.input_length > prev.input_length + prev.output_length:
                    extended += 1
                break
        latest[r.hash_ids[: len(r.hash_ids) - 1]] = r
    assert extended > 0.5 * len(recs)
    # Skewed system prompts: the most popular first block is far above the median.
    firsts = Counter(r.hash_ids[0] for r in recs if r.hash_ids)
    counts = sorted(firsts.values(), reverse=True)
    assert counts[0] > 5 * counts[len(counts) // 2]
    # One-off documents: long requests whose unshared blocks never recur.
    seen = Counter(tuple(r.hash_ids[: j + 1]) for r in recs for j in range(len(r.hash_ids)))
    one_off = [r for r in recs if seen[tuple(r.hash_ids[:2])] == 1 and len(r.hash_ids) > 4]
    assert len(one_off) > 0.02 * len(recs)
    # Poisson-ish arrivals at roughly the configured rate.
    span_s = (recs[-1].timestamp - recs[0].timestamp) / 1000
    assert 0.5 * cfg.rate < len(recs) / span_s < 2 * cfg.rate


def test_synth_sessions_option_and_validation() -> None:
    recs = synthesize(requests=200, seed=1, sessions=10, doc_fraction=0.0)
    assert len(recs) == 200
    with pytest.raises(ValueError, match="rate"):
        synthesize(requests=10, rate=0)


def test_trace_synth_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.jsonl"
    assert main(["trace", "synth", "--requests", "60", "--seed", "4", "--out", str(out)]) == 0
    assert load_trace(out) == synthesize(requests=60, seed=4)
    assert main(["trace", "synth", "--requests", "5", "--seed", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(x) for x in lines] == [r.to_dict() for r in synthesize(requests=5, seed=4)]
    assert main(["trace", "stats", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests"] == 60 and 0 < stats["unique_blocks"] <= stats["blocks"]
