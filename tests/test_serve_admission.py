"""Predicted early rejection in a running ``kvpool serve --router conductor``.

Real processes (front end, prefill and decode workers, a pool; the tiny
preset). A burst of requests arrives faster than they can prefill, so none of
them is in the decode worker's KV yet: the decode load *now* is zero and
rejecting on it (``rejection=now``) would admit the whole burst and overload
the decode worker a prefill later (the paper's oscillation). The conductor's
``rejection=predicted`` asks the simulator's predictor
(``LiveDecodeLedger`` -> ``DecodeLoadPredictor.predict_peak``, then
``admission.admit_decode``): the requests it admitted are pending in the
ledger, so the predicted peak reaches the decode capacity after the first
few and the rest are answered 429 with the predictor's reason. Once the
burst has drained, the ledger is empty and a new request is admitted again.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from servehelpers import start_serve  # noqa: E402

KV_TOKENS = 2048  # the one decode worker's KV memory
HEADROOM = 0.9  # admission target: 1,843 KV tokens
PROMPT = 600  # each request weighs 600 + the mean reply (256 before any finished) tokens
BURST = 6


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def _wait_kv_free(client: httpx.Client, why: str) -> None:
    deadline = time.monotonic() + 30
    free = None
    while free != KV_TOKENS and time.monotonic() < deadline:
        free = _metric(client.get("/metrics").text, "kvpool_serve_decode_kv_free_tokens")
        if free != KV_TOKENS:
            time.sleep(0.1)
    assert free == KV_TOKENS, why


def test_predicted_rejection_refuses_a_burst_the_load_now_would_admit() -> None:
    server = start_serve(
        [
            *("--model", "tiny", "--port", "0", "--threads", "1"),
            *("--block-tokens", "16", "--dram", "64MiB", "--kv-tokens", str(KV_TOKENS)),
            *("--router", "conductor", "--router-opt", "rejection=predicted"),
            *("--router-opt", f"headroom={HEADROOM}"),
        ]
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            # the decode worker's KV figures reach the router with its first report
            _wait_kv_free(client, "the decode worker never reported its KV memory")

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                # distinct prompts (no shared prefix), long replies: nothing finishes
                # before the burst has been routed
                return await asyncio.gather(
                    *(
                        client.post(
                            "/v1/completions",
                            json={
                                "prompt": [(i * 7 + j) % 250 + 1 for j in range(PROMPT)],
                                "max_tokens": 160,
                                "ignore_eos": True,
                            },
                        )
                        for i in range(BURST)
                    )
                )

        replies = asyncio.run(burst())
        ok = [r for r in replies if r.status_code == 200]
        refused = [r for r in replies if r.status_code == 429]
        assert len(ok) + len(refused) == BURST, [r.text for r in replies]
        # 2 x 856 = 1,712 fits the 1,843-token target, a third (2,568) does not
        capacity = KV_TOKENS * HEADROOM
        weight = PROMPT + 256
        assert len(ok) == int(capacity // weight) == 2
        for r in refused:
            reason = r.json()["error"]["message"]
            m = re.fullmatch(r"predicted decode load ([0-9.e+]+) at capacity ([0-9.e+]+)", reason)
            assert m, reason  # the predictor's path, not the TTFT check or the load now
            load, cap = float(m.group(1)), float(m.group(2))
            assert cap == pytest.approx(capacity)
            # the two admitted requests, pending in the ledger (not yet in decode KV)
            assert load >= 2 * weight and load + weight > cap
        with httpx.Client(base_url=server.url, timeout=60) as client:
            metrics = client.get("/metrics").text
            assert _metric(metrics, "kvpool_serve_rejected_total") == len(refused)
            # drained: the admitted requests finished (the ledger is empty) and the
            # decode worker's next report shows its KV free again: room again
            _wait_kv_free(client, "the decode worker's KV was not freed")
            r = client.post("/v1/completions", json={"prompt": [5] * PROMPT, "max_tokens": 4})
            assert r.status_code == 200, r.text
    finally:
        server.child.stop(30)
