"""``kvpool trace synth --profile conversation``: the look-alike's shape and its CLI.

The bounds are the shape of the production trace's statistics (issue 16:
p90/p50 ~4.0, p99/p50 ~12.4, mean/p50 ~1.74, replies p50 350 / p90 597,
76 % single-use blocks, one block in every request, infinite-cache hit ratio
0.38, 3.4 requests/s), with room for sampling noise at 3,000 requests; they
hold for every seed tried (0-9).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvpool.cli import main
from kvpool.workload.conversation import ConversationConfig, conversation_trace, shape_stats
from kvpool.workload.traces import load_trace


@pytest.fixture(scope="module")
def stats() -> dict[str, float]:
    return shape_stats(conversation_trace(requests=3000, seed=1))


def test_prompt_lengths_are_heavy_tailed(stats: dict[str, float]) -> None:
    p50 = stats["prompt_p50"]
    assert 5000 <= p50 <= 10000
    assert 3.0 <= stats["prompt_p90"] / p50 <= 5.5
    assert 7.0 <= stats["prompt_p99"] / p50 <= 18.0
    assert 1.45 <= stats["prompt_mean"] / p50 <= 2.1
    assert stats["prompt_max"] <= 128_000


def test_replies_are_light_tailed(stats: dict[str, float]) -> None:
    assert 300 <= stats["output_p50"] <= 400
    assert 1.4 <= stats["output_p90"] / stats["output_p50"] <= 2.0
    assert 0.9 <= stats["output_mean"] / stats["output_p50"] <= 1.15


def test_block_reuse_shape(stats: dict[str, float]) -> None:
    assert stats["max_block_share"] == 1.0  # the preamble block: every request
    assert 0.65 <= stats["single_use_block_share"] <= 0.85
    assert 0.30 <= stats["infinite_hit_ratio"] <= 0.46
    assert 2.9 <= stats["rate_rps"] <= 3.9


def test_sessions_extend_the_previous_prompt_with_correlated_think_times() -> None:
    records = conversation_trace(requests=3000, seed=4)
    longest_system = ConversationConfig().system_blocks[1]
    by_prefix: dict[tuple[int, ...], int] = {}
    prev_of: dict[int, int] = {}
    for i, r in enumerate(records):
        full = r.input_length // 512
        # a prefix longer than any system prompt is a session's: an earlier turn
        for k in range(full, longest_system, -1):
            p = by_prefix.get(r.hash_ids[:k])
            if p is not None and records[p].input_length // 512 == k:
                prev = records[p]
                assert r.input_length >= prev.input_length + prev.output_length
                assert r.timestamp > prev.timestamp
                prev_of[i] = p
                break
        by_prefix[r.hash_ids[:full]] = i
    assert len(prev_of) > 0.1 * len(records)
    # successive think gaps of one session are correlated (per-session pace, AR(1))
    pairs = [
        (
            records[p].timestamp - records[prev_of[p]].timestamp,
            records[i].timestamp - records[p].timestamp,
        )
        for i, p in prev_of.items()
        if p in prev_of
    ]
    assert len(pairs) >= 30
    logs = np.log(np.array(pairs, dtype=float))
    assert np.corrcoef(logs[:, 0], logs[:, 1])[0, 1] > 0.3
    assert conversation_trace(requests=3000, seed=4) == records  # deterministic
    assert conversation_trace(requests=300, seed=5) != records[:300]


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="think_rho"):
        conversation_trace(requests=10, think_rho=1.0)
    with pytest.raises(ValueError, match="mean_turns"):
        ConversationConfig(mean_turns=0.5).validate()
    assert conversation_trace(requests=0) == []


def test_cli_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.jsonl"
    argv = ["trace", "synth", "--profile", "conversation", "--requests", "400", "--seed", "2"]
    assert main([*argv, "--rate", "5", "--out", str(out)]) == 0
    records = load_trace(str(out))
    assert len(records) == 400
    assert records == conversation_trace(requests=400, seed=2, rate=5.0)
    capsys.readouterr()
    assert main(["trace", "stats", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["max_block_share"] == 1.0 and "single_use_block_share" in d
    assert main([*argv, "--doc-fraction", "0.2"]) == 2
    assert "--doc-fraction does not apply to --profile conversation" in capsys.readouterr().err
