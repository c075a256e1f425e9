"""``kvpool bench serve --checkpoint``: the peer comparison runs end to end at small sizes
(kvpool serve and transformers; vLLM skipped with its reason when its python is absent)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers (the dev extra) is absent")


def test_bench_serve_checkpoint_compares_the_peers(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "peers.json"
    cmd = [sys.executable, "-m", "kvpool", "bench", "serve", "--checkpoint", "tiny"]
    cmd += ["--requests", "2", "--max-tokens", "3", "--shared-prefix", "80"]
    cmd += ["--unique-tokens", "8", "--levels", "1,2", "--rounds", "1"]
    cmd += ["--vllm-python", str(tmp_path / "no-python"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * 2 * 2  # peers x kinds x levels
    for row in rows:
        if row["runtime"].startswith("vLLM"):
            assert "no-python missing" in row["skipped"]
            continue
        assert row["skipped"] is None and row["ttft_p50_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["rounds"][0]["errors"] == 0
    assert "| kvpool serve (1P+1D) | prefix 80 | 2 |" in proc.stdout


def test_unknown_peer_is_refused() -> None:
    cmd = [sys.executable, "-m", "kvpool", "bench", "serve", "--checkpoint", "tiny"]
    proc = subprocess.run([*cmd, "--peers", "kvpool,tgi"], capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown peers ['tgi']" in proc.stderr


def test_event_lines_split_at_newlines_only() -> None:
    """vLLM writes U+2028 / U+0085 unescaped inside JSON strings: they are not line ends."""
    import asyncio

    from kvpool.serve.runtime.http.load import _sse_lines

    class Response:
        async def aiter_text(self):  # type: ignore[no-untyped-def]
            for part in ('data: {"t": "x\u2028y\x85', 'z"}\r\n\ndata: [DO', "NE]\n\n"):
                yield part

    async def lines() -> list[str]:
        return [line async for line in _sse_lines(Response())]

    got = asyncio.run(lines())
    assert got == ['data: {"t": "x\u2028y\x85z"}', "", "data: [DONE]", ""]
    assert json.loads(got[0][6:]) == {"t": "x\u2028y\x85z"}
