"""The routing seam (no processes): least-loaded choices, rejection, the registry."""

from __future__ import annotations

import pytest

from kvpool.serve.runtime.http.load import common_prefix, make_prompts, percentiles
from kvpool.serve.sched.presets import get_preset
from kvpool.serve.sched.router_api import (
    DECODE,
    PREFILL,
    RouteDecision,
    Router,
    RouterContext,
    WorkerState,
)
from kvpool.serve.sched.routing import ROUTERS, LeastLoadedRouter, make_router, parse_options


def _workers() -> list[WorkerState]:
    return [
        WorkerState("p0", PREFILL, queued_requests=2, queued_tokens=900),
        WorkerState("p1", PREFILL, queued_requests=3, queued_tokens=300),
        WorkerState("p2", PREFILL, queued_requests=0, queued_tokens=0, alive=False),
        WorkerState("d0", DECODE, running=5, queued_requests=1),
        WorkerState("d1", DECODE, running=2, queued_requests=1, queued_tokens=50),
        WorkerState("d2", DECODE, running=2, queued_requests=1, queued_tokens=10),
    ]


def test_least_loaded_picks_fewest_queued_tokens_and_requests() -> None:
    router = LeastLoadedRouter()
    assert isinstance(router, Router)
    decision = router.route(100, [b"k" * 16], _workers())
    assert decision == RouteDecision(prefill="p1", decode="d2")  # p2 is dead


def test_least_loaded_rejects_only_when_asked_and_without_workers() -> None:
    router = LeastLoadedRouter(max_queued_tokens=300)
    assert router.route(10, [], _workers()).reject
    assert LeastLoadedRouter().route(10, [], [w for w in _workers() if w.kind == DECODE]).reject


def test_registry_builds_routers_from_context() -> None:
    ctx = RouterContext(
        get_preset("tiny"), "kvpool://127.0.0.1:1", options={"max_queued_tokens": "7"}
    )
    router = make_router("least-loaded", ctx)
    assert isinstance(router, LeastLoadedRouter) and router.max_queued_tokens == 7
    assert "least-loaded" in ROUTERS
    with pytest.raises(ValueError, match="unknown router"):
        make_router("nope", ctx)
    assert parse_options(["a=1", "b = x"]) == {"a": "1", "b": "x"}
    with pytest.raises(ValueError):
        parse_options(["novalue"])


def test_bench_helpers() -> None:
    prompts = make_prompts(5, 40, 30, seed=1)
    assert all(len(p) == 40 for p in prompts)
    assert common_prefix(prompts) >= 30
    pct = percentiles([0.001 * i for i in range(1, 101)])
    assert pct["p50"] == pytest.approx(51.0) and pct["p99"] == pytest.approx(100.0)


def test_serve_command_parses() -> None:
    from kvpool.cli import build_parser
    from kvpool.serve.cli import main

    args = build_parser().parse_args(["serve", "--model", "tiny", "--decode", "2"])
    assert args.decode == 2 and args.router == "least-loaded" and args.pool is None
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0


class _Reject:
    def route(
        self, prompt_tokens: int, keys: list[bytes], workers: list[WorkerState]
    ) -> RouteDecision:
        assert prompt_tokens == 4 and len(keys) == 0  # 4 tokens: no full 16-token block
        assert {w.worker_id for w in workers} == {"p0", "d0"}
        return RouteDecision(reject="over the TTFT SLO")


def _frontend(router: Router, alive: bool = True):  # type: ignore[no-untyped-def]
    from kvpool.serve.runtime.http.frontend import Frontend
    from kvpool.serve.runtime.http.state import ServeSettings, WorkerHandle

    fe = Frontend(ServeSettings(get_preset("tiny", block_tokens=16), "tiny"), router, None)
    fe.fleet.handles = {
        "p0": WorkerHandle("p0", PREFILL, alive=alive),
        "d0": WorkerHandle("d0", DECODE, alive=True),
    }
    return fe


def test_router_rejection_is_429_and_no_worker_is_503() -> None:
    import asyncio

    import httpx

    async def scenario() -> None:
        app = _frontend(_Reject()).app()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            r = await client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 2})
            assert r.status_code == 429
            assert r.json()["error"]["message"] == "over the TTFT SLO"
            assert r.headers["retry-after"] == "1"
            metrics = (await client.get("/metrics")).text
            assert "kvpool_serve_rejected_total 1.0" in metrics
            assert 'kvpool_serve_requests_total{status="429"} 1.0' in metrics
        app = _frontend(LeastLoadedRouter(), alive=False).app()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as client:
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503

    asyncio.run(scenario())
