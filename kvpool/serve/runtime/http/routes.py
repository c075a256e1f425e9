"""The HTTP routes of ``kvpool serve`` (Starlette on uvicorn).

- ``POST /v1/completions``: the OpenAI completion object (``openai``), or
  server-sent events with ``stream``; errors are OpenAI error objects.
- ``POST /v1/chat/completions``: the same through the checkpoint's chat template
  (``chat``; 400 for a model without one).
- ``GET /v1/models``: the served model (and its kvpool preset, seed, block size).
- ``GET /health``: 200 while each kind has a live worker, else 503; lists the workers.
- ``GET /metrics``: Prometheus text (``metrics``).

Unknown paths and methods answer 404/405 as OpenAI error objects. With
``--api-key`` the ``/v1`` routes answer 401 without ``Authorization: Bearer
KEY`` (``/health`` and ``/metrics`` stay open, for probes and scrapers); a
request body over ``--max-body-bytes`` answers 413 without being read whole.
"""

from __future__ import annotations

import hmac
import json

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.serve.runtime.http.answers import Answers
from kvpool.serve.runtime.http.chat import parse_chat
from kvpool.serve.runtime.http.dispatch import Dispatcher
from kvpool.serve.runtime.http.fleet import WorkerFleet
from kvpool.serve.runtime.http.metrics import ServeMetrics
from kvpool.serve.runtime.http.openai import ApiError, parse_completion
from kvpool.serve.runtime.http.state import ServeSettings
from kvpool.serve.sched.router_api import DECODE, PREFILL


def build_app(
    settings: ServeSettings,
    fleet: WorkerFleet,
    dispatch: Dispatcher,
    metrics: ServeMetrics,
    created: int,
) -> Starlette:
    """The ASGI app over one front end's parts (``created``: the model's timestamp)."""
    s = settings
    answers = Answers(dispatch)

    def authorize(request: Request) -> None:
        if s.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {s.api_key}".encode()):
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                "authentication_error",
                code="invalid_api_key",
            )

    async def read_body(request: Request) -> bytes:
        limit = s.max_body_bytes
        too_big = ApiError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat=True)

    async def answer(request: Request, chat: bool) -> Response:
        try:
            authorize(request)
            raw = await read_body(request)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"malformed JSON: {exc}") from None
            if chat:
                fields = parse_chat(body, s, dispatch.tokenizer, dispatch.chat_template)
            else:
                fields = parse_completion(body, s, dispatch.tokenizer)
            reqs = await dispatch.begin_all(fields, chat=chat)
            if fields.stream:
                return StreamingResponse(
                    answers.stream(reqs),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            result = await answers.complete(reqs)
        except ApiError as exc:
            metrics.requests.labels(str(exc.status)).inc()
            return exc.response()
        metrics.requests.labels("200").inc()
        return JSONResponse(result)

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": s.served_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "kvpool",
                        "max_model_len": s.model.max_context,
                        "kvpool": {
                            "preset": s.model.name,
                            "seed": s.seed,
                            "block_tokens": s.model.block_tokens,
                            "vocab_size": s.model.vocab_size,
                        },
                    }
                ],
            }
        )

    async def health(_request: Request) -> Response:
        states = fleet.states()
        ok = all(any(s.alive for s in states if s.kind == k) for k in (PREFILL, DECODE))
        workers = []
        for s in states:
            h = fleet.handles[s.worker_id]
            workers.append(
                {
                    "id": s.worker_id,
                    "kind": s.kind,
                    "alive": s.alive,
                    "pid": h.pid,
                    "address": s.address,
                    "restarts": h.restarts,
                    "queued_requests": s.queued_requests,
                    "queued_tokens": s.queued_tokens,
                    "running": s.running,
                }
            )
        return JSONResponse(
            {"status": "ok" if ok else "degraded", "workers": workers},
            status_code=200 if ok else 503,
        )

    async def metrics_text(_request: Request) -> Response:
        text = await run_in_threadpool(metrics.text)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return ApiError(status, f"{request.method} {request.url.path}: not found").response()

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_text, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: not_found},
    )
