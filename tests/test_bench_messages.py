"""Smoke test of ``kvpool bench messages``: every sample message round-trips, JSON shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpool.bench.messages import register_messages, run_messages, sample_messages
from kvpool.rpc.frame import HEADER_SIZE, decode_body, encode_frame
from kvpool.rpc.messages import Request, decode_envelope, encode_envelope


def test_sample_messages_round_trip() -> None:
    for msg in sample_messages().values():
        frame = encode_frame(encode_envelope(Request(1, "m", msg)))
        request = decode_envelope(decode_body(frame[HEADER_SIZE:]))
        assert type(msg).from_dict(request.params) == msg  # type: ignore[union-attr]


def test_bench_messages_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    register_messages(parser.add_subparsers(dest="suite"))
    out = tmp_path / "rows.json"
    args = parser.parse_args(["messages", "--rounds", "1", "--per-round", "5", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert [r["message"] for r in rows] == list(sample_messages())
    for row in rows:
        assert row["kvpool_us"] > 0 and row["msgpack_us"] > 0 and row["frame_bytes"] > 0
    assert "kvpool µs" in capsys.readouterr().out
    with pytest.raises(ValueError, match="rounds"):
        run_messages(rounds=0)
