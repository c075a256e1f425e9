"""``kvpool serve --cpp-group``: long prompts prefilled by a pipeline group, end to end.

One server (tiny model, 2 prefill workers forming one 2-stage group, 16-token
blocks, pipeline from 200 tokens) serves every test in this module, in order.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from servehelpers import Server, start_serve

from kvpool.serve.runtime.model import Transformer, build_model, generate
from kvpool.serve.sched.presets import get_preset
from kvpool.serve.sched.router_api import (
    DECODE,
    PREFILL,
    RouteDecision,
    RouterContext,
    WorkerState,
)
from kvpool.serve.sched.routing import make_router

torch.set_num_threads(1)
BT = 16
MIN_TOKENS = 200


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_serve(
        [
            *("--model", "tiny", "--port", "0"),
            *("--prefill", "2", "--cpp-group", "2", "--cpp-min-tokens", str(MIN_TOKENS)),
            *("--block-tokens", str(BT), "--chunk-tokens", "64", "--dram", "64MiB"),
            *("--kv-tokens", "4096", "--max-tokens-limit", "256", "--page-tokens", "8"),
        ],
    )
    popen = server.popen
    yield server
    if popen.poll() is None:
        popen.terminate()
        try:
            assert popen.wait(30) == 0
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(10)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build_model("tiny", 0, block_tokens=BT)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def _complete(url: str, ids: list[int], max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _health(url: str) -> dict[str, dict[str, object]]:
    return {w["id"]: w for w in httpx.get(f"{url}/health", timeout=10).json()["workers"]}


def _pipelined(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'^kvpool_serve_pipeline_requests_total\{group="g0"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_long_prompt_goes_through_the_pipeline_and_is_exact(
    server: Server, model: Transformer
) -> None:
    ids = _prompt(1, 5 * 64 + 7)  # 5 full chunks and a bit, a partial last block
    r = _complete(server.url, ids)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["kvpool"]["pipeline"] == ["p0", "p1"]
    assert out["kvpool"]["prefill_worker"] == "g0"
    assert out["kvpool"]["computed_tokens"] == len(ids)
    assert out["choices"][0]["token_ids"] == generate(model, ids, 8)
    assert _pipelined(server.url) == 1.0


def test_short_prompt_is_never_split_and_is_exact(server: Server, model: Transformer) -> None:
    ids = _prompt(2, MIN_TOKENS - 1)
    r = _complete(server.url, ids)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["kvpool"]["pipeline"] == []
    assert out["kvpool"]["prefill_worker"] in ("p0", "p1")
    assert out["choices"][0]["token_ids"] == generate(model, ids, 8)
    assert _pipelined(server.url) == 1.0


def test_pipeline_reuses_a_cached_prefix(server: Server, model: Transformer) -> None:
    ids = _prompt(1, 5 * 64 + 7)[: 16 * BT] + _prompt(3, 100)  # 16 blocks cached by test 1
    r = _complete(server.url, ids, max_tokens=6)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["kvpool"]["pipeline"] == ["p0", "p1"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * BT
    assert out["choices"][0]["token_ids"] == generate(model, ids, 6)
    assert _pipelined(server.url) == 2.0


def test_concurrent_pipelined_prompts_are_exact(server: Server, model: Transformer) -> None:
    prompts = [_prompt(10 + i, 250 + 40 * i) for i in range(3)]
    results: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        results[i] = _complete(server.url, prompts[i], 5)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, p in enumerate(prompts):
        out = results[i].json()
        assert out["kvpool"]["pipeline"] == ["p0", "p1"]
        assert out["choices"][0]["token_ids"] == generate(model, p, 5)
    assert _pipelined(server.url) == 5.0


def test_a_dead_stage_fails_its_request_and_the_group_comes_back(
    server: Server, model: Transformer
) -> None:
    pid = int(_health(server.url)["p1"]["pid"])  # type: ignore[call-overload]
    os.kill(pid, signal.SIGSTOP)  # the group still looks ready: the request reaches it
    result: dict[str, httpx.Response] = {}
    ids = _prompt(4, 300)
    t = threading.Thread(target=lambda: result.setdefault("r", _complete(server.url, ids)))
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _health(server.url)["p1"]["queued_requests"] == 0:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    r = result["r"]
    assert 500 <= r.status_code < 600, r.text
    assert "g0" in r.json()["error"]["message"]

    deadline = time.monotonic() + 60  # p1 is restarted and the group re-linked
    while time.monotonic() < deadline:
        r = _complete(server.url, ids)
        if r.status_code == 200 and r.json()["kvpool"]["pipeline"]:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert r.json()["kvpool"]["pipeline"] == ["p0", "p1"]
    assert r.json()["choices"][0]["token_ids"] == generate(model, ids, 8)
    assert _health(server.url)["p1"]["restarts"] == 1


def test_prefill_must_be_a_multiple_of_the_group() -> None:
    cmd = [sys.executable, "-m", "kvpool", "serve", "--prefill", "3", "--cpp-group", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "multiple of --cpp-group" in r.stderr


# -- routing decisions (no server) ---------------------------------------------------


def _group_workers(ready: bool = True) -> list[WorkerState]:
    g = "g0" if ready else None
    return [
        WorkerState("p0", PREFILL, group=g, stage=0),
        WorkerState("p1", PREFILL, group=g, stage=1),
        WorkerState("p2", PREFILL),
        WorkerState("d0", DECODE),
    ]


def _ctx(**options: str) -> RouterContext:
    tiny = get_preset("tiny", block_tokens=BT)
    return RouterContext(tiny, "", options=options, cpp_min_tokens=4096, chunk_tokens=512)


def test_least_loaded_pipelines_from_the_token_threshold() -> None:
    router = make_router("least-loaded", _ctx())
    assert router.route(4096, [], _group_workers()) == RouteDecision(group="g0", decode="d0")
    assert router.route(4095, [], _group_workers()).group is None
    assert router.route(8000, [], _group_workers(ready=False)).group is None  # not linked


def test_conductor_pipelines_only_what_one_worker_cannot_do_faster() -> None:
    router = make_router("conductor", _ctx(rejection="none"))
    assert router.route(8192, [], _group_workers()) == RouteDecision(group="g0", decode="d0")
    assert router.route(1000, [], _group_workers()).group is None  # fits one worker's SLO
    assert router.route(8192, [], _group_workers(ready=False)).group is None
    # a busy group: its busiest member's queue makes one idle worker faster
    busy = _group_workers()
    busy[1].queued_tokens, busy[1].queued_requests = 60000, 4
    decision = router.route(8192, [], busy)
    assert decision.group is None and decision.prefill in ("p0", "p2")  # idle ones
