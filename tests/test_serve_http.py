"""``kvpool serve`` end to end: a real server process with its master, node and workers.

One server (tiny model, 16-token blocks) serves every test in this module, in
order; the last test stops it with SIGTERM and checks that every child is
gone and no shared memory is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from servehelpers import Server, start_serve

from kvpool.serve.runtime.model import Transformer, build_model, generate
from kvpool.serve.runtime.tokenizer import EOS, ByteTokenizer

torch.set_num_threads(1)
BT = 16


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_serve(
        [
            *("--model", "tiny", "--port", "0"),
            *("--block-tokens", str(BT), "--dram", "64MiB", "--kv-tokens", "4096"),
            *("--max-tokens-limit", "1024", "--page-tokens", "8"),
        ],
    )
    popen = server.popen
    yield server
    if popen.poll() is None:
        kids = _descendants(popen.pid)
        popen.terminate()
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            popen.kill()
        for pid in kids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build_model("tiny", 0, block_tokens=BT)


def _complete(url: str, timeout: float = 60.0, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _stream(url: str, **body: object) -> list[dict[str, object] | str]:
    events: list[dict[str, object] | str] = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_and_health(server: Server) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["kvpool"]["block_tokens"] == BT
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok"
    assert sorted(w["id"] for w in body["workers"]) == ["d0", "p0"]
    assert all(w["alive"] and w["pid"] for w in body["workers"])


def test_completion_equals_reference(server: Server, model: Transformer) -> None:
    text = "kvpool keeps the keys and values of every prompt."
    tokens = ByteTokenizer().encode(text)
    r = _complete(server.url, model="tiny", prompt=text, max_tokens=12)
    assert r.status_code == 200, r.text
    body = r.json()
    want = generate(model, tokens, 12, eos_id=EOS)
    choice = body["choices"][0]
    assert choice["token_ids"] == want
    assert choice["text"] == ByteTokenizer().decode([t for t in want if t != EOS])
    assert choice["finish_reason"] == ("stop" if want[-1] == EOS else "length")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    assert usage["completion_tokens"] == len(want)
    assert usage["total_tokens"] == len(tokens) + len(want)
    assert body["kvpool"]["computed_tokens"] + body["kvpool"]["cached_tokens"] == len(tokens)

    ids = list(range(40, 77))  # a prompt of token ids
    r = _complete(server.url, prompt=ids, max_tokens=5, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == generate(model, ids, 5)


def test_streaming_equals_reference(server: Server, model: Transformer) -> None:
    ids = [7, 99, 3, *range(100, 130)]
    events = _stream(server.url, prompt=ids, max_tokens=10, ignore_eos=True)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert len(chunks) == 10  # one event per token
    got = [c["choices"][0]["token_ids"][0] for c in chunks]  # type: ignore[index]
    assert got == generate(model, ids, 10)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 9 + ["length"]  # type: ignore[index]
    assert all(c["object"] == "text_completion" for c in chunks)

    events = _stream(
        server.url, prompt="usage please", max_tokens=3, stream_options={"include_usage": True}
    )
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert isinstance(last, dict) and last["choices"] == []
    assert last["usage"]["prompt_tokens"] == len(ByteTokenizer().encode("usage please"))  # type: ignore[index]


def test_shared_prefix_reports_cached_tokens(server: Server, model: Transformer) -> None:
    g = torch.Generator().manual_seed(7)
    first = torch.randint(0, 256, (57,), generator=g).tolist()  # 3 blocks + 9
    second = first[:48] + torch.randint(0, 256, (13,), generator=g).tolist()
    r1 = _complete(server.url, prompt=first, max_tokens=6, ignore_eos=True).json()
    r2 = _complete(server.url, prompt=second, max_tokens=6, ignore_eos=True).json()
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert r2["kvpool"]["computed_tokens"] == 13
    assert r1["choices"][0]["token_ids"] == generate(model, first, 6)
    assert r2["choices"][0]["token_ids"] == generate(model, second, 6)


def test_concurrent_requests_are_batched_and_exact(server: Server, model: Transformer) -> None:
    prompts = [[10 + i, *range(50, 70 + 3 * i)] for i in range(4)]
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        r = _complete(server.url, prompt=prompts[i], max_tokens=8, ignore_eos=True)
        results[i] = r.json()["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, p in enumerate(prompts):
        assert results[i] == generate(model, p, 8)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'"a string"', 400, None),
        (b'{"max_tokens": 4}', 400, "prompt"),
        (b'{"prompt": []}', 400, "prompt"),
        (b'{"prompt": [1, 2, 999]}', 400, "prompt"),
        (b'{"prompt": [[1, 2], [3]]}', 400, "prompt"),
        (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"prompt": "hi", "n": 0}', 400, "n"),
        (b'{"prompt": "hi", "n": 17}', 400, "n"),
        (b'{"prompt": "hi", "n": 1.5}', 400, "n"),
        (b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),
        (b'{"prompt": "hi", "logprobs": -1}', 400, "logprobs"),
        (b'{"prompt": "hi", "logprobs": true}', 400, "logprobs"),
        (b'{"prompt": "hi", "top_logprobs": 2}', 400, "top_logprobs"),
        (b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
        (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    ],
)
def test_bad_input_is_4xx_json(server: Server, body: bytes, status: int, param: str | None) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == param


def test_too_long_prompt_and_unknown_routes(server: Server) -> None:
    r = _complete(server.url, prompt=[1] * 4000, max_tokens=200)  # the decode KV holds 4096
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{server.url}/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_metrics(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["kvpool_serve_ttft_seconds_count"] >= 5
    assert values["kvpool_serve_tbt_seconds_count"] >= 20
    assert values["kvpool_serve_prefix_hit_tokens_total"] >= 48
    assert values['kvpool_serve_requests_total{status="200"}'] >= 5
    assert values['kvpool_serve_requests_total{status="400"}'] >= 1
    assert values['kvpool_serve_worker_up{kind="decode",worker="d0"}'] == 1
    assert 'kvpool_serve_worker_queued_requests{kind="prefill",worker="p0"}' in values
    assert values["kvpool_pool_blocks"] >= 3
    assert any(k.startswith("kvpool_pool_node_used_bytes") for k in values)


def test_bench_serve_load(server: Server) -> None:
    from kvpool.serve.runtime.http.load import format_result, run_load

    result = run_load(
        server.url, concurrency=3, requests=6, max_tokens=5, prompt_tokens=40, shared_prefix=32
    )
    assert result.errors == 0 and result.output_tokens == 30
    assert result.cached_tokens >= 5 * 32  # every request after the first reuses the prefix
    assert result.ttft_ms["p50"] > 0 and result.tbt_ms["p99"] > 0
    assert "TTFT" in format_result(result)


def _health(url: str) -> dict[str, dict[str, object]]:
    return {w["id"]: w for w in httpx.get(f"{url}/health", timeout=5).json()["workers"]}


@pytest.mark.parametrize("n", [1, 3])
def test_client_leaving_a_stream_cancels_its_decode(server: Server, n: int) -> None:
    body = {"prompt": [9] * 20, "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": n}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for n, _line in enumerate(r.iter_lines()):  # until the worker reports it running
            if n % 20 == 19 and _health(server.url)["d0"]["running"]:
                break
    deadline = time.monotonic() + 5  # 1000 tokens would take several seconds more
    while time.monotonic() < deadline and _health(server.url)["d0"]["running"]:
        time.sleep(0.05)
    assert _health(server.url)["d0"]["running"] == 0


def test_killed_worker_fails_its_requests_then_serving_resumes(
    server: Server, model: Transformer
) -> None:
    pid = int(_health(server.url)["d0"]["pid"])  # type: ignore[call-overload]
    result: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r", _complete(server.url, prompt=[5] * 20, max_tokens=1000, ignore_eos=True)
        )
    )
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _health(server.url)["d0"]["running"] == 0:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    r = result["r"]
    assert 500 <= r.status_code < 600, r.text
    assert "d0" in r.json()["error"]["message"]

    deadline = time.monotonic() + 40  # the supervisor restarts it
    while time.monotonic() < deadline:
        d0 = _health(server.url)["d0"]
        if d0["alive"] and d0["pid"] != pid:
            break
        time.sleep(0.1)
    assert d0["alive"] and d0["restarts"] == 1
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    r = _complete(server.url, prompt=ids, max_tokens=5, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == generate(model, ids, 5)


def test_killed_worker_mid_stream_ends_it_with_an_error_event(server: Server) -> None:
    pid = int(_health(server.url)["d0"]["pid"])  # type: ignore[call-overload]
    body = {"prompt": [6] * 20, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:
                os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "d0" in error["message"] and error["type"] == "server_error"
    assert 5 <= len(events) - 2 < 1000  # some tokens, then the error


def test_sigterm_stops_every_child_and_frees_shared_memory(server: Server) -> None:
    # The tests before this one kill d0: wait until the supervisor has it back.
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and not all(w["alive"] for w in _health(server.url).values()):
        time.sleep(0.1)
    kids = _descendants(server.popen.pid)
    assert len(kids) >= 4  # master, node, p0, d0
    server.popen.send_signal(signal.SIGTERM)
    assert server.popen.wait(30) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in kids):
        time.sleep(0.05)
    assert not [p for p in kids if _alive(p)]
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"kvpool-{p}-") for p in kids)]
    assert not left
    time.sleep(0.2)
    assert any("kvpool serve stopped" in line for line in server.lines)
