"""The HTTP front end of ``kvpool serve``: OpenAI-style completions over the workers.

Endpoints (Starlette on uvicorn):

- ``POST /v1/completions``: ``prompt`` (text, tokenized by the byte tokenizer
  with a leading BOS, or a list of token ids), ``max_tokens`` (default 16),
  ``stream``, ``stream_options.include_usage``, ``ignore_eos``; greedy
  decoding only (``temperature``/``top_p`` are accepted and ignored; ``n``
  must be 1). The answer is the OpenAI completion object (``usage`` with
  ``prompt_tokens_details.cached_tokens``; each choice also carries
  ``token_ids``; ``kvpool`` holds the workers used, cached/computed tokens
  and TTFT). With ``stream`` it is server-sent events, one ``text_completion``
  chunk per token, then ``data: [DONE]``.
- ``GET /v1/models``, ``GET /health`` (200 while each kind has a live
  worker, else 503; lists the workers), ``GET /metrics`` (Prometheus).

A request's life: validate (4xx) -> ``Router.route`` over the live workers'
``WorkerState`` (reject -> 429; no live worker of a kind -> 503) -> prefill
RPC (the first token comes back with the KV in the pool; it is sent to the
client at once) -> decode submit -> token events from the decode worker's
long-poll pump, in order -> done. A worker that dies fails its in-flight
requests with 502 (an ``error`` event mid-stream) and is restarted by the
supervisor thread; requests route around it meanwhile.

Pipeline groups (``--cpp-group k``, ``ServeSettings.groups``): prefill
workers p0..p(k-1) are also stages 0..k-1 of group g0, and so on. The front
end links each group's stages into a chain at start; a group is *ready* while
every member is live and was linked in its current incarnation, and only
then do its members carry ``WorkerState.group`` for the router. A decision
naming a group makes this process the coordinator of a pipeline prefill
(``kvpool.serve.runtime.pipeline.pipeline_prefill``: reserve the blocks, start the stages,
commit); decode then proceeds exactly as after a single-worker prefill. A
member that dies fails the request with 502 (the other stages abort it, every
reservation is aborted); the supervisor restarts the member and re-links the
group, which is ready again once the chain is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.errors import KVPoolError
from kvpool.index.keys import block_keys
from kvpool.rpc.client import RpcClient
from kvpool.serve.runtime.procs import Child
from kvpool.serve.runtime.tokenizer import EOS, VOCAB_SIZE, ByteTokenizer
from kvpool.serve.sched.presets import ModelConfig
from kvpool.serve.sched.router_api import (
    DECODE,
    PREFILL,
    Observation,
    RouteDecision,
    Router,
    WorkerState,
)

log = logging.getLogger("kvpool.serve")

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0,
)  # fmt: skip


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass
class ServeSettings:
    model: ModelConfig
    served_name: str
    seed: int = 0
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    decode_kv_tokens: int = 32768  # each decode worker's KV memory
    page_tokens: int = 16
    restart: bool = True  # restart dead workers
    events_wait_s: float = 1.0
    groups: dict[str, list[str]] = field(default_factory=dict)  # pipeline group -> stages
    chunk_tokens: int = 512  # the pipeline's chunk

    @property
    def eos_id(self) -> int | None:
        return EOS if self.model.vocab_size == VOCAB_SIZE else None


@dataclass
class WorkerHandle:
    worker_id: str
    kind: str
    child: Child | None = None
    client: RpcClient | None = None
    alive: bool = False
    broken: bool = False  # connection lost; the supervisor replaces it
    restarts: int = 0
    inflight: dict[str, ServeRequest] = field(default_factory=dict)
    reported: dict[str, Any] = field(default_factory=dict)
    generation: int = 0
    started_at: float = 0.0  # monotonic time of the last (re)start
    quick_failures: int = 0  # deaths soon after a start, in a row
    retry_at: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child else None


@dataclass
class ServeRequest:
    id: str
    tokens: list[int]
    max_tokens: int
    eos_id: int | None
    stream: bool
    include_usage: bool
    arrival: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    prefill_worker: str = ""
    decode_worker: str = ""
    cached_tokens: int = 0
    computed_tokens: int = 0
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    prefill_timings: dict[str, float] = field(default_factory=dict)
    pipeline: list[str] = field(default_factory=list)  # the stages, when pipelined

    def push(self, item: tuple[Any, ...]) -> None:
        """Thread-safe: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.arrival if self.times else None

    @property
    def tbt(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


class Frontend:
    """Workers (handles, pumps, supervisor), routing, metrics and the ASGI app."""

    def __init__(
        self,
        settings: ServeSettings,
        router: Router,
        launch: Callable[[str, str], Child] | None,
        pool: Any = None,
    ) -> None:
        self.s = settings
        self.router = router
        self.launch = launch
        self.pool = pool
        self.tokenizer = ByteTokenizer()
        self.namespace = settings.model.namespace(settings.seed)
        self.handles: dict[str, WorkerHandle] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.created = int(time.time())
        self._group_of = {w: (g, i) for g, ms in settings.groups.items() for i, w in enumerate(ms)}
        self._linked: dict[str, tuple[int, ...]] = {}  # group -> member generations linked
        self._metrics()

    # -- workers -----------------------------------------------------------------

    def add_worker(self, worker_id: str, kind: str, child: Child) -> None:
        handle = WorkerHandle(worker_id, kind)
        self.handles[worker_id] = handle
        self._attach(handle, child)

    def _attach(self, handle: WorkerHandle, child: Child) -> None:
        client = RpcClient(child.address, name="kvpool-serve", reconnect=False, timeout=10)
        with self._lock:
            handle.child, handle.client = child, client
            handle.alive, handle.broken = True, False
            handle.generation += 1
            handle.reported = {}
            handle.started_at = time.monotonic()
        if handle.kind == DECODE:
            t = threading.Thread(
                target=self._pump,
                args=(handle, client, handle.generation),
                name=f"kvpool-serve-pump-{handle.worker_id}",
                daemon=True,
            )
            t.start()

    def _generations(self, group: str) -> tuple[int, ...]:
        return tuple(self.handles[w].generation for w in self.s.groups[group])

    def group_ready(self, group: str) -> bool:
        members = [self.handles.get(w) for w in self.s.groups[group]]
        return all(h is not None and h.alive for h in members) and self._linked.get(
            group
        ) == self._generations(group)

    def link_group(self, group: str) -> bool:
        """Connect each stage of ``group`` to the next; the group is ready on success."""
        gens = self._generations(group)
        members = [self.handles[w] for w in self.s.groups[group]]
        try:
            for a, b in itertools.pairwise(members):
                if a.client is None or b.child is None or not (a.alive and b.alive):
                    return False
                a.client.call("link", {"address": b.child.address}, timeout=10)
        except KVPoolError as exc:
            log.warning("linking pipeline group %s failed: %s", group, exc)
            return False
        with self._lock:
            self._linked[group] = gens
        return True

    def start(self) -> None:
        for group in self.s.groups:
            if not self.link_group(group):
                raise RuntimeError(f"could not link pipeline group {group}")
        for target, name in ((self._supervise, "supervisor"), (self._poll_loads, "loads")):
            t = threading.Thread(target=target, name=f"kvpool-serve-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=3)
        for h in self.handles.values():
            if h.client is not None:
                h.client.close()

    def children(self) -> list[Child]:
        return [h.child for h in self.handles.values() if h.child is not None]

    def _mark_down(self, handle: WorkerHandle, generation: int, reason: str) -> None:
        with self._lock:
            if handle.generation != generation or not handle.alive:
                return
            handle.alive, handle.broken = False, True
            failed = list(handle.inflight.values())
            handle.inflight.clear()
        log.warning("worker %s down: %s", handle.worker_id, reason)
        self.m_worker_failures.labels(handle.worker_id).inc()
        for req in failed:
            req.push(("err", 502, f"{handle.kind} worker {handle.worker_id} failed: {reason}"))

    def _pump(self, handle: WorkerHandle, client: RpcClient, generation: int) -> None:
        """Long-poll ``decode.events`` and route every event to its request."""
        while not self._stop.is_set() and handle.generation == generation:
            try:
                reply = client.call(
                    "decode.events",
                    {"wait_s": self.s.events_wait_s},
                    timeout=self.s.events_wait_s + 10,
                )
            except KVPoolError as exc:
                if not self._stop.is_set():
                    self._mark_down(handle, generation, str(exc))
                return
            for rid, token, index, finished, error in reply["events"]:
                with self._lock:
                    req = handle.inflight.get(rid)
                    if req is not None and finished:
                        del handle.inflight[rid]
                if req is None:
                    continue
                if error:
                    req.push(("err", 500, f"decode failed: {error}"))
                else:
                    req.push(("tok", int(token), int(index), bool(finished)))

    def _supervise(self) -> None:
        """Mark dead workers down and restart them; a worker that keeps dying soon
        after its start is retried with exponential backoff (up to 30 s)."""
        while not self._stop.wait(0.2):
            for h in list(self.handles.values()):
                dead = h.child is not None and not h.child.alive()
                if dead and h.alive:
                    code = h.child.popen.returncode if h.child else None
                    self._mark_down(h, h.generation, f"process exited ({code})")
                if not (h.broken and self.s.restart and self.launch) or self._stop.is_set():
                    continue
                now = time.monotonic()
                if now < h.retry_at:
                    continue
                if h.child is not None:
                    h.child.stop(2.0)
                if h.client is not None:
                    h.client.close()
                h.quick_failures = h.quick_failures + 1 if now - h.started_at < 10 else 0
                h.retry_at = now + min(30.0, 0.5 * 2**h.quick_failures)
                try:
                    child = self.launch(h.kind, h.worker_id)
                except Exception as exc:
                    log.error("restarting %s failed: %s", h.worker_id, exc)
                    continue
                if self._stop.is_set():
                    child.stop(2.0)
                    return
                h.restarts += 1
                self.m_restarts.labels(h.worker_id).inc()
                self._attach(h, child)
                log.warning("worker %s restarted (pid %d)", h.worker_id, child.pid)
            for g in self.s.groups:  # re-form groups whose members came back
                if not self.group_ready(g) and not self._stop.is_set():
                    members = [self.handles.get(w) for w in self.s.groups[g]]
                    if all(m is not None and m.alive for m in members) and self.link_group(g):
                        log.warning("pipeline group %s re-linked", g)

    def _poll_loads(self) -> None:
        while not self._stop.wait(0.25):
            for h in list(self.handles.values()):
                client = h.client
                if not h.alive or client is None:
                    continue
                with contextlib.suppress(KVPoolError):
                    h.reported = dict(client.call("load", timeout=2))

    def states(self) -> list[WorkerState]:
        out = []
        ready = {g for g in self.s.groups if self.group_ready(g)}
        with self._lock:
            for h in self.handles.values():
                rep = h.reported
                reqs = list(h.inflight.values())
                st = WorkerState(
                    h.worker_id,
                    h.kind,
                    address=h.child.address if h.child else "",
                    alive=h.alive,
                    completed=int(rep.get("completed", 0)),
                    reported=rep,
                )
                if h.kind == PREFILL:
                    g = self._group_of.get(h.worker_id)
                    if g is not None and g[0] in ready:
                        st.group, st.stage = g
                    st.queued_requests = len(reqs)
                    st.queued_tokens = sum(len(r.tokens) for r in reqs)
                    st.running = int(rep.get("running", 0))
                else:
                    running = int(rep.get("running", 0))
                    st.running = running
                    st.queued_requests = max(0, len(reqs) - running)
                    st.queued_tokens = sum(
                        len(r.tokens) + r.max_tokens - len(r.output) for r in reqs
                    )
                    st.kv_free_tokens = rep.get("kv_free_tokens")
                    st.kv_capacity_tokens = rep.get("kv_capacity_tokens")
                    st.max_batch = rep.get("max_batch")
                out.append(st)
        return out

    # -- requests ----------------------------------------------------------------

    def parse(self, body: Any) -> dict[str, Any]:
        """Validated request fields, or ApiError (4xx)."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.s.served_name:
            raise ApiError(
                404, f"model {model!r} is not served here", param="model", code="model_not_found"
            )
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", param="prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        vocab = self.s.model.vocab_size
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"token ids must be in [0, {vocab})", param="prompt")
            tokens = list(prompt)
        else:
            raise ApiError(
                400,
                "'prompt' must be a string or a list of token ids (batches are not supported)",
                param="prompt",
            )
        if not tokens:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        max_tokens = body.get("max_tokens", 16)
        if max_tokens is None:
            max_tokens = 16
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise ApiError(400, "'max_tokens' must be an integer", param="max_tokens")
        if not 1 <= max_tokens <= self.s.max_tokens_limit:
            raise ApiError(
                400,
                f"'max_tokens' must be between 1 and {self.s.max_tokens_limit}",
                param="max_tokens",
            )
        limit = min(self.s.model.max_context, self.s.decode_kv_tokens)
        if len(tokens) + max_tokens - 1 > limit:
            raise ApiError(
                400,
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context of {limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        n = body.get("n", 1)
        if n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        ignore_eos = bool(body.get("ignore_eos", False))
        return {
            "tokens": tokens,
            "max_tokens": max_tokens,
            "stream": stream,
            "include_usage": bool(opts.get("include_usage", False)),
            "eos_id": None if ignore_eos else self.s.eos_id,
        }

    def route(self, tokens: list[int]) -> tuple[list[WorkerHandle], WorkerHandle, str | None]:
        """(prefill handles: one worker or a group's stages in order, decode handle, group)."""
        states = self.states()
        for kind in (PREFILL, DECODE):
            if not any(s.alive for s in states if s.kind == kind):
                raise ApiError(503, f"no {kind} worker is available", "server_error")
        keys = block_keys(tokens, self.namespace, self.s.model.block_tokens) if tokens else []
        live = [s for s in states if s.alive]
        decision = self.router.route(len(tokens), keys, live)
        if not isinstance(decision, RouteDecision):
            raise ApiError(500, "router returned no decision", "server_error")
        if decision.reject:
            self.m_rejected.inc()
            raise ApiError(429, decision.reject, "rate_limit_exceeded", code="rejected")
        d = self.handles.get(decision.decode or "")
        if decision.group is not None:
            members = self.s.groups.get(decision.group)
            if members is None or d is None or d.kind != DECODE:
                raise ApiError(500, f"router chose unknown workers {decision}", "server_error")
            return [self.handles[w] for w in members], d, decision.group
        p = self.handles.get(decision.prefill or "")
        if p is None or d is None or p.kind != PREFILL or d.kind != DECODE:
            raise ApiError(500, f"router chose unknown workers {decision}", "server_error")
        return [p], d, None

    async def begin(self, fields: dict[str, Any]) -> ServeRequest:
        """Route, prefill and hand to decode; errors are ApiError with a status."""
        req = ServeRequest(
            id=f"cmpl-{uuid.uuid4().hex[:24]}",
            tokens=fields["tokens"],
            max_tokens=fields["max_tokens"],
            eos_id=fields["eos_id"],
            stream=fields["stream"],
            include_usage=fields["include_usage"],
            arrival=time.perf_counter(),
            loop=asyncio.get_running_loop(),
        )
        self.m_inflight.inc()
        try:
            # off the event loop: a router may ask the pool (an RPC) where prefixes are
            ps, d, group = await run_in_threadpool(self.route, req.tokens)
            req.decode_worker = d.worker_id
            if group is None:
                req.prefill_worker = ps[0].worker_id
                result = await self._prefill(req, ps[0])
            else:
                req.prefill_worker, req.pipeline = group, [p.worker_id for p in ps]
                result = await self._prefill_pipeline(req, group, ps)
            self._first_token(req, result)
            if req.max_tokens > 1 and result["first_token"] != req.eos_id:
                await self._submit_decode(req, d, result)
            else:
                req.finished = True
                self._remove_tail(result)
        except BaseException:
            self.m_inflight.dec()
            raise
        return req

    async def _prefill(self, req: ServeRequest, p: WorkerHandle) -> dict[str, Any]:
        client = p.client
        with self._lock:
            if client is None or not p.alive:
                raise ApiError(
                    503, f"prefill worker {p.worker_id} is not available", "server_error"
                )
            p.inflight[req.id] = req
        try:
            fut = client.submit("prefill.run", {"request_id": req.id, "tokens": req.tokens})
            result: dict[str, Any] = await asyncio.wrap_future(fut)
        except KVPoolError as exc:
            raise ApiError(
                502, f"prefill worker {p.worker_id} failed: {exc}", "server_error"
            ) from None
        finally:
            with self._lock:
                p.inflight.pop(req.id, None)
        self._account(req, result)
        self._observe(
            Observation(
                "prefill",
                p.worker_id,
                len(req.tokens),
                cached_tokens=req.cached_tokens,
                seconds=req.prefill_timings.get("total_s", 0.0),
                queue_seconds=req.prefill_timings.get("queue_s", 0.0),
            )
        )
        return result

    def _account(self, req: ServeRequest, result: dict[str, Any]) -> None:
        req.cached_tokens = int(result["cached_tokens"])
        req.computed_tokens = int(result["computed_tokens"])
        req.prefill_timings = dict(result.get("timings", {}))
        self.m_prompt_tokens.inc(len(req.tokens))
        self.m_cached_tokens.inc(req.cached_tokens)
        self.m_computed_tokens.inc(req.computed_tokens)

    async def _prefill_pipeline(
        self, req: ServeRequest, group: str, stages: list[WorkerHandle]
    ) -> dict[str, Any]:
        """Coordinate a pipeline prefill over ``stages`` (this process reserves and
        commits the blocks); any failure is a 502 and nothing half-written stays."""
        from kvpool.serve.runtime.pipeline import pipeline_prefill

        with self._lock:
            clients = [h.client for h in stages]
            if self.pool is None or not all(h.alive for h in stages) or None in clients:
                raise ApiError(503, f"pipeline group {group} is not available", "server_error")
            for h in stages:  # counts as queued work on every member (routing, /health)
                h.inflight[req.id] = req
        try:
            res = await run_in_threadpool(
                pipeline_prefill,
                self.pool,
                self.s.model,
                clients,  # type: ignore[arg-type]
                req.tokens,
                chunk_tokens=self.s.chunk_tokens,
                request_id=req.id,
                seed=self.s.seed,
            )
        except Exception as exc:
            self.m_pipeline_failures.labels(group).inc()
            raise ApiError(
                502, f"pipeline group {group} failed: {type(exc).__name__}: {exc}", "server_error"
            ) from None
        finally:
            with self._lock:
                for h in stages:
                    h.inflight.pop(req.id, None)
        result = res.to_dict()
        self.m_pipeline.labels(group).inc()
        self._account(req, result)
        return result

    def _first_token(self, req: ServeRequest, result: dict[str, Any]) -> None:
        token = int(result["first_token"])
        now = time.perf_counter()
        req.output.append(token)
        req.times.append(now)
        self.m_ttft.observe(now - req.arrival)
        self.m_generated.inc()

    async def _submit_decode(
        self, req: ServeRequest, d: WorkerHandle, result: dict[str, Any]
    ) -> None:
        client = d.client
        with self._lock:
            if client is None or not d.alive:
                raise ApiError(503, f"decode worker {d.worker_id} is not available", "server_error")
            d.inflight[req.id] = req  # before submit: events may arrive before the reply
        try:
            fut = client.submit(
                "decode.submit",
                {"handoff": result, "max_new_tokens": req.max_tokens, "eos_id": req.eos_id},
            )
            await asyncio.wrap_future(fut)
        except KVPoolError as exc:
            with self._lock:
                d.inflight.pop(req.id, None)
            raise ApiError(
                502, f"decode worker {d.worker_id} failed: {exc}", "server_error"
            ) from None

    def _remove_tail(self, result: dict[str, Any]) -> None:
        tail = result.get("tail_key")
        if tail and self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.remove(tail)

    async def tokens(self, req: ServeRequest) -> AsyncIterator[tuple[int, bool]]:
        """(token, finished) in order, the prefill's first token included; ApiError on failure."""
        try:
            yield req.output[0], req.finished
            while not req.finished:
                item = await req.queue.get()
                if item[0] == "err":
                    req.error = str(item[2])
                    raise ApiError(int(item[1]), str(item[2]), "server_error")
                _, token, index, finished = item
                if index == 0:  # decode re-emits the prefill's token at admission
                    req.finished = finished
                    continue
                now = time.perf_counter()
                self.m_tbt.observe(now - req.times[-1])
                req.output.append(token)
                req.times.append(now)
                self.m_generated.inc()
                req.finished = finished
                yield token, finished
        finally:
            self._end(req)

    def _end(self, req: ServeRequest) -> None:
        self.m_inflight.dec()
        if not req.finished:  # client left or failed: stop decoding it
            d = self.handles.get(req.decode_worker)
            if d is not None:
                with self._lock:
                    known = d.inflight.pop(req.id, None) is not None
                if known and d.client is not None and d.alive:
                    with contextlib.suppress(KVPoolError):
                        d.client.submit("decode.cancel", {"request_id": req.id})
        else:
            self.m_e2e.observe(time.perf_counter() - req.arrival)
        self._observe(
            Observation(
                "request",
                req.prefill_worker,
                len(req.tokens),
                cached_tokens=req.cached_tokens,
                output_tokens=len(req.output),
                ttft=req.ttft,
                tbt=req.tbt,
                decode_worker=req.decode_worker,
                error=req.error,
            )
        )

    def _observe(self, obs: Observation) -> None:
        observe = getattr(self.router, "observe", None)
        if observe is not None:
            try:
                observe(obs)
            except Exception:
                log.exception("router.observe failed")

    # -- responses ---------------------------------------------------------------

    def finish_reason(self, req: ServeRequest) -> str:
        return "stop" if req.output and req.output[-1] == req.eos_id else "length"

    def usage(self, req: ServeRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": len(req.tokens),
            "completion_tokens": len(req.output),
            "total_tokens": len(req.tokens) + len(req.output),
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    def extras(self, req: ServeRequest) -> dict[str, Any]:
        return {
            "prefill_worker": req.prefill_worker,
            "decode_worker": req.decode_worker,
            "cached_tokens": req.cached_tokens,
            "computed_tokens": req.computed_tokens,
            "ttft_s": req.ttft,
            "tbt_mean_s": (sum(req.tbt) / len(req.tbt)) if req.tbt else None,
            "prefill_timings": req.prefill_timings,
            "pipeline": req.pipeline,  # the stages' workers when pipelined, else []
        }

    def body(self, req: ServeRequest, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        """A text_completion object (a whole response or one stream chunk)."""
        return {
            "id": req.id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.s.served_name,
            "choices": choices,
            **more,
        }

    @staticmethod
    def choice(text: str, finish: str | None, token_ids: list[int]) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "token_ids": token_ids,
        }

    def chunk(self, req: ServeRequest, text: str, token: int | None, finish: str | None) -> str:
        body = self.body(req, [self.choice(text, finish, [] if token is None else [token])])
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, req: ServeRequest) -> AsyncIterator[str]:
        dec = self.tokenizer.decode_stream()
        try:
            async for token, finished in self.tokens(req):
                text = "" if token == req.eos_id else dec.feed(token)
                if finished:
                    text += dec.flush()
                yield self.chunk(req, text, token, self.finish_reason(req) if finished else None)
            if req.include_usage:
                body = self.body(req, [], usage=self.usage(req), kvpool=self.extras(req))
                yield f"data: {json.dumps(body)}\n\n"
            self.m_requests.labels("200").inc()
        except ApiError as exc:
            self.m_requests.labels(str(exc.status)).inc()
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    async def complete(self, req: ServeRequest) -> dict[str, Any]:
        async for _ in self.tokens(req):
            pass
        out = [t for t in req.output if t != req.eos_id]
        text = self.tokenizer.decode(out)
        return self.body(
            req,
            [self.choice(text, self.finish_reason(req), list(req.output))],
            usage=self.usage(req),
            kvpool=self.extras(req),
        )

    # -- metrics -----------------------------------------------------------------

    def _metrics(self) -> None:
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter(
            "kvpool_serve_requests", "Completions answered, by HTTP status", ["status"], registry=r
        )
        self.m_rejected = Counter(
            "kvpool_serve_rejected", "Requests the router rejected (429)", registry=r
        )
        self.m_ttft = Histogram(
            "kvpool_serve_ttft_seconds",
            "Time to first token (request arrival to first token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.m_tbt = Histogram(
            "kvpool_serve_tbt_seconds",
            "Time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.m_e2e = Histogram(
            "kvpool_serve_e2e_seconds",
            "Request latency (arrival to last token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.m_inflight = Gauge("kvpool_serve_inflight_requests", "Requests in flight", registry=r)
        self.m_prompt_tokens = Counter(
            "kvpool_serve_prompt_tokens", "Prompt tokens prefilled", registry=r
        )
        self.m_cached_tokens = Counter(
            "kvpool_serve_prefix_hit_tokens",
            "Prompt tokens whose KV came from the pool",
            registry=r,
        )
        self.m_computed_tokens = Counter(
            "kvpool_serve_computed_prompt_tokens", "Prompt tokens run through the model", registry=r
        )
        self.m_generated = Counter(
            "kvpool_serve_generated_tokens", "Output tokens sent to clients", registry=r
        )
        self.m_pipeline = Counter(
            "kvpool_serve_pipeline_requests",
            "Requests prefilled by a pipeline group (--cpp-group)",
            ["group"],
            registry=r,
        )
        self.m_pipeline_failures = Counter(
            "kvpool_serve_pipeline_failures",
            "Pipeline prefills that failed (502)",
            ["group"],
            registry=r,
        )
        self.m_restarts = Counter(
            "kvpool_serve_worker_restarts", "Worker restarts", ["worker"], registry=r
        )
        self.m_worker_failures = Counter(
            "kvpool_serve_worker_failures",
            "Workers found dead or unreachable",
            ["worker"],
            registry=r,
        )
        r.register(_StateCollector(self))

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    # -- app ---------------------------------------------------------------------

    def app(self) -> Starlette:
        fe = self

        async def completions(request: Request) -> Response:
            try:
                raw = await request.body()
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ApiError(400, f"malformed JSON: {exc}") from None
                fields = fe.parse(body)
                req = await fe.begin(fields)
                if req.stream:
                    return StreamingResponse(
                        fe.stream(req),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"},
                    )
                result = await fe.complete(req)
            except ApiError as exc:
                fe.m_requests.labels(str(exc.status)).inc()
                return exc.response()
            fe.m_requests.labels("200").inc()
            return JSONResponse(result)

        async def models(_request: Request) -> Response:
            return JSONResponse(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": fe.s.served_name,
                            "object": "model",
                            "created": fe.created,
                            "owned_by": "kvpool",
                            "max_model_len": fe.s.model.max_context,
                            "kvpool": {
                                "preset": fe.s.model.name,
                                "seed": fe.s.seed,
                                "block_tokens": fe.s.model.block_tokens,
                                "vocab_size": fe.s.model.vocab_size,
                            },
                        }
                    ],
                }
            )

        async def health(_request: Request) -> Response:
            states = fe.states()
            ok = all(any(s.alive for s in states if s.kind == k) for k in (PREFILL, DECODE))
            workers = []
            for s in states:
                h = fe.handles[s.worker_id]
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

        async def metrics(_request: Request) -> Response:
            text = await run_in_threadpool(fe.metrics_text)
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

        async def not_found(request: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 404)
            return ApiError(status, f"{request.method} {request.url.path}: not found").response()

        return Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/metrics", metrics, methods=["GET"]),
            ],
            exception_handlers={404: not_found, 405: not_found},
        )


class _StateCollector:
    """Scrape-time gauges: worker load and the pool's stats."""

    def __init__(self, fe: Frontend) -> None:
        self.fe = fe

    def collect(self) -> Any:
        fe = self.fe
        up = GaugeMetricFamily(
            "kvpool_serve_worker_up", "1 while the worker is live", labels=["worker", "kind"]
        )
        queued = GaugeMetricFamily(
            "kvpool_serve_worker_queued_requests",
            "Requests queued at the worker",
            labels=["worker", "kind"],
        )
        tokens = GaugeMetricFamily(
            "kvpool_serve_worker_queued_tokens",
            "Tokens queued at the worker",
            labels=["worker", "kind"],
        )
        running = GaugeMetricFamily(
            "kvpool_serve_worker_running",
            "Requests running at the worker",
            labels=["worker", "kind"],
        )
        kv_free = GaugeMetricFamily(
            "kvpool_serve_decode_kv_free_tokens",
            "Free KV slots of a decode worker",
            labels=["worker"],
        )
        for s in fe.states():
            labels = [s.worker_id, s.kind]
            up.add_metric(labels, 1.0 if s.alive else 0.0)
            queued.add_metric(labels, s.queued_requests)
            tokens.add_metric(labels, s.queued_tokens)
            running.add_metric(labels, s.running)
            if s.kv_free_tokens is not None:
                kv_free.add_metric([s.worker_id], s.kv_free_tokens)
        yield from (up, queued, tokens, running, kv_free)
        if fe.pool is None:
            return
        try:
            stats = fe.pool.stats()
        except Exception:
            return
        for key, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                g = GaugeMetricFamily(f"kvpool_pool_{key}", f"pool stats: {key}")
                g.add_metric([], float(value))
                yield g
        for section, label in (("tiers", "tier"), ("nodes", "node")):
            entries = stats.get(section)
            if not isinstance(entries, dict):
                continue
            fams: dict[str, GaugeMetricFamily] = {}
            for name, vals in entries.items():
                if not isinstance(vals, dict):
                    continue
                for key, value in vals.items():
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        fam = fams.get(key)
                        if fam is None:
                            fam = fams[key] = GaugeMetricFamily(
                                f"kvpool_pool_{label}_{key}",
                                f"pool stats per {label}: {key}",
                                labels=[label],
                            )
                        fam.add_metric([str(name)], float(value))
            yield from fams.values()
