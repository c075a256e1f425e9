"""kvpool replay against a small fake OpenAI-compatible SSE server (no kvpool serve needed)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvpool.serve.sched.replay import build_plan
from kvpool.serve.sched.replay_results import percentile_of
from kvpool.workload.synth import synthesize
from kvpool.workload.traces import write_trace

pytest.importorskip("httpx")


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    seen: ClassVar[list[dict]] = []
    lock = threading.Lock()
    prefixes: ClassVar[set[tuple[int, ...]]] = set()

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.seen.append(body)
            n = len(self.seen)
            prompt = body["prompt"]
            # prefix cache at 16-token blocks: how many leading blocks were seen before
            cached = 0
            for end in range(16, len(prompt) + 1, 16):
                if tuple(prompt[:end]) not in self.prefixes:
                    break
                cached = end
            for end in range(16, len(prompt) + 1, 16):
                self.prefixes.add(tuple(prompt[:end]))
        if n % 5 == 0:  # every fifth request is rejected, like the conductor's 429
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "rejected", "code": "rejected"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(0.01)  # "prefill"
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [i]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        usage = {
            "choices": [],
            "usage": {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": body["max_tokens"],
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


class FakeServer(ThreadingHTTPServer):
    # The replay opens up to 30 connections at once: with socketserver's default
    # listen backlog (5), a loaded machine overflowed it and the dropped handshakes
    # came back as read errors or ~1 s SYN retries (seen once in a local suite run).
    request_queue_size = 128


@pytest.fixture()
def server():
    FakeHandler.seen = []
    FakeHandler.prefixes = set()
    srv = FakeServer(("127.0.0.1", 0), FakeHandler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_build_plan_keeps_prefix_sharing() -> None:
    recs = synthesize(requests=60, seed=2, rate=50.0)
    plan = build_plan(recs, speed=2.0, block_tokens=16, scale_output=0.01, max_output=4)
    for rec, prompt, out in zip(recs, plan.prompts, plan.max_tokens, strict=True):
        assert len(prompt) == max(1, round(rec.input_length * 16 / 512))
        assert 1 <= out <= 4 and all(0 <= t < 256 for t in prompt)
    # two records that share their first k block ids share their first k * 16 tokens
    for i in range(len(recs)):
        for j in range(i):
            a, b = recs[i].hash_ids, recs[j].hash_ids
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            n = min(k * 16, len(plan.prompts[i]), len(plan.prompts[j]))
            assert plan.prompts[i][:n] == plan.prompts[j][:n]
    assert plan.arrivals[0] == 0.0
    assert plan.arrivals[-1] == pytest.approx((recs[-1].timestamp - recs[0].timestamp) / 2000)


def test_replay_against_fake_server(server, tmp_path) -> None:
    from kvpool.cli import main

    recs = synthesize(requests=30, seed=5, rate=200.0, think_time_s=0.05)
    trace = tmp_path / "t.jsonl"
    write_trace(recs, trace)
    out = tmp_path / "r.json"
    plots = tmp_path / "plots"
    argv = [
        "replay",
        str(trace),
        "--url",
        server,
        "--speed",
        "4",
        "--block-tokens",
        "16",
        "--scale-output",
        "0.02",
        "--max-output",
        "6",
        "--json",
        str(out),
        "--no-progress",
    ]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(plots)]
    except ImportError:
        plots = None  # type: ignore[assignment]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 30
    # the probe was request 1; every fifth request (counting the probe) got a 429
    assert data["rejected"] == len(FakeHandler.seen) // 5
    assert data["completed"] + data["rejected"] == 30 and data["failed"] == 0
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p50_s", "tbt_p90_s", "tbt_p99_s"):
        assert data[key] >= 0
    assert data["ttft_p50_s"] <= data["ttft_p99_s"]
    assert 0.0 <= data["ttft_slo_attainment"] <= 1.0 and data["goodput_rps"] > 0
    assert data["hit_ratio"] is not None and 0.0 < data["hit_ratio"] < 1.0
    sent = FakeHandler.seen[1:]  # after the probe
    assert all(b["stream"] and b["ignore_eos"] for b in sent)
    assert all(1 <= b["max_tokens"] <= 6 for b in sent)
    if plots is not None:
        assert (plots / "ttft_cdf.png").stat().st_size > 0
        assert (plots / "tbt_cdf.png").stat().st_size > 0


def test_percentile_of() -> None:
    assert percentile_of([], 90) == 0.0
    assert percentile_of([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile_of(list(range(1, 101)), 90) == 90


def test_replay_against_kvpool_serve_with_conductor(tmp_path) -> None:
    """End to end: ``kvpool serve --router conductor`` answers a replayed trace."""
    pytest.importorskip("torch")
    import os
    import re
    import subprocess
    import sys

    from kvpool.serve.sched.replay import replay

    popen = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvpool", "serve", "--model", "tiny", "--port", "0"),
            *("--block-tokens", "16", "--dram", "64MiB", "--kv-tokens", "4096"),
            *("--threads", "1", "--router", "conductor", "--router-opt", "rejection=predicted"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert popen.stdout is not None
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = popen.stdout.readline()
            if not line:
                break
            m = re.search(r"ready on (http://[\d.]+:\d+)", line)
            url = m.group(1) if m else None
        assert url, "kvpool serve did not start"
        assert "router conductor" in line
        recs = synthesize(requests=12, seed=4, rate=20.0, think_time_s=0.2, system_prompts=2)
        result = replay(
            url,
            recs,
            speed=1.0,
            block_tokens=16,
            scale_output=0.01,
            max_output=4,
            progress=False,
            timeout=60.0,
        )
        assert result["requests"] == 12 and result["failed"] == 0
        assert result["completed"] + result["rejected"] == 12 and result["completed"] > 0
        assert result["hit_ratio"] is not None and result["hit_ratio"] > 0  # shared prefixes
        assert result["ttft_p50_s"] > 0
    finally:
        popen.terminate()
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            popen.kill()
