"""Request dispatch: route, prefill (one worker or a pipeline group), decode, stream.

A request's life: ``Router.route`` over the live workers' ``WorkerState``
(reject -> 429; no live worker of a kind -> 503) -> prefill RPC (the first
token comes back with the KV in the pool; it is sent to the client at once)
-> ``decode.submit`` -> token events from the decode worker's pump, in order
-> done. A worker that dies fails its in-flight requests with 502 (an
``error`` event mid-stream); requests route around it meanwhile.

A decision naming a pipeline group makes this process the coordinator of a
pipeline prefill (``kvpool.serve.runtime.pipeline.pipeline_prefill``:
reserve the blocks, start the stages, commit); decode then proceeds exactly
as after a single-worker prefill. A member that dies fails the request with
502 (the other stages abort it, every reservation is aborted).

The router is told what was measured (``Router.observe``, when it has one)
after every prefill and at the end of every request.

A request with ``n > 1`` runs as ``n`` choices (``begin_all``): each is routed,
prefilled and decoded on its own, with its own seed. ``tokens`` yields a
choice's tokens as they come; ``answers.Answers`` shapes them into the API's
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from kvpool.cluster.client.remote_pool import RemotePool
from kvpool.errors import KVPoolError
from kvpool.index.keys import block_keys
from kvpool.serve.runtime.http.fleet import WorkerFleet
from kvpool.serve.runtime.http.metrics import ServeMetrics
from kvpool.serve.runtime.http.openai import (
    ApiError,
    CompletionRequest,
)
from kvpool.serve.runtime.http.state import ServeRequest, ServeSettings, WorkerHandle
from kvpool.serve.runtime.http.stopping import StopState
from kvpool.serve.runtime.sampling import TokenLogprobs
from kvpool.serve.sched.router_api import DECODE, PREFILL, Observation, RouteDecision, Router

if TYPE_CHECKING:
    from kvpool.api import KVStore

log = logging.getLogger("kvpool.serve")


class Dispatcher:
    """Carries each request from routing to its last token."""

    def __init__(
        self,
        settings: ServeSettings,
        router: Router,
        fleet: WorkerFleet,
        metrics: ServeMetrics,
        pool: KVStore | None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.fleet = fleet
        self.metrics = metrics
        self.pool = pool
        self.tokenizer = settings.tokenizer()
        self.chat_template = settings.chat_template()
        self.namespace = settings.model.namespace(settings.seed)

    def route(self, tokens: list[int]) -> tuple[list[WorkerHandle], WorkerHandle, str | None]:
        """(prefill handles: one worker or a group's stages in order, decode handle, group)."""
        states = self.fleet.states()
        for kind in (PREFILL, DECODE):
            if not any(s.alive for s in states if s.kind == kind):
                raise ApiError(503, f"no {kind} worker is available", "server_error")
        keys = (
            block_keys(tokens, self.namespace, self.settings.model.block_tokens) if tokens else []
        )
        live = [s for s in states if s.alive]
        decision = self.router.route(len(tokens), keys, live)
        if not isinstance(decision, RouteDecision):
            raise ApiError(500, "router returned no decision", "server_error")
        if decision.reject:
            self.metrics.rejected.inc()
            raise ApiError(429, decision.reject, "rate_limit_exceeded", code="rejected")
        d = self.fleet.handles.get(decision.decode or "")
        if decision.group is not None:
            members = self.settings.groups.get(decision.group)
            if members is None or d is None or d.kind != DECODE:
                raise ApiError(500, f"router chose unknown workers {decision}", "server_error")
            return [self.fleet.handles[w] for w in members], d, decision.group
        p = self.fleet.handles.get(decision.prefill or "")
        if p is None or d is None or p.kind != PREFILL or d.kind != DECODE:
            raise ApiError(500, f"router chose unknown workers {decision}", "server_error")
        return [p], d, None

    async def begin_all(self, fields: CompletionRequest, chat: bool = False) -> list[ServeRequest]:
        """``begin`` each of the request's ``n`` choices: the first alone, then the
        others at once (their prompt's full blocks are in the pool by then). If one
        fails, the ones begun are abandoned and its ApiError raised."""
        first = await self.begin(fields, chat)
        if fields.n == 1:
            return [first]
        rest = await asyncio.gather(
            *(self.begin(fields, chat, i, first.id) for i in range(1, fields.n)),
            return_exceptions=True,
        )
        reqs = [first, *(r for r in rest if isinstance(r, ServeRequest))]
        errors = [r for r in rest if isinstance(r, BaseException)]
        if errors:
            for req in reqs:
                req.error = str(errors[0])
                self._end(req)
            raise errors[0]
        return reqs

    async def begin(
        self, fields: CompletionRequest, chat: bool = False, index: int = 0, response_id: str = ""
    ) -> ServeRequest:
        """Route, prefill and hand to decode choice ``index`` of the request (its id
        towards the workers: ``response_id-index``); errors are ApiError with a status."""
        rid = f"{response_id}-{index}" if index else f"cmpl-{uuid.uuid4().hex[:24]}"
        req = ServeRequest(
            id=rid,
            tokens=fields.tokens,
            max_tokens=fields.max_tokens,
            eos_id=fields.eos_id,
            stream=fields.stream,
            include_usage=fields.include_usage,
            arrival=time.perf_counter(),
            loop=asyncio.get_running_loop(),
            stopper=StopState(self.tokenizer, fields.eos_id, fields.stop, fields.stop_token_ids),
            chat=chat,
            sampling=fields.sampling.for_choice(index),
            index=index,
            response_id=response_id,
        )
        self.metrics.inflight.inc()
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
            stopped = self._first_token(req, result)
            if req.max_tokens > 1 and not stopped:
                await self._submit_decode(req, d, result)
            else:
                req.finished = True
                self._remove_tail(result)
        except BaseException:
            self.metrics.inflight.dec()
            raise
        return req

    async def _prefill(self, req: ServeRequest, p: WorkerHandle) -> dict[str, Any]:
        client = p.client
        with self.fleet.lock:
            if client is None or not p.alive:
                raise ApiError(
                    503, f"prefill worker {p.worker_id} is not available", "server_error"
                )
            p.inflight[req.id] = req
        try:
            call = {"request_id": req.id, "tokens": req.tokens, "sampling": req.sampling.to_dict()}
            fut = client.submit("prefill.run", call)
            result: dict[str, Any] = await asyncio.wrap_future(fut)
        except KVPoolError as exc:
            raise ApiError(
                502, f"prefill worker {p.worker_id} failed: {exc}", "server_error"
            ) from None
        finally:
            with self.fleet.lock:
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
        self.metrics.prompt_tokens.inc(len(req.tokens))
        self.metrics.cached_tokens.inc(req.cached_tokens)
        self.metrics.computed_tokens.inc(req.computed_tokens)

    async def _prefill_pipeline(
        self, req: ServeRequest, group: str, stages: list[WorkerHandle]
    ) -> dict[str, Any]:
        """Coordinate a pipeline prefill over ``stages`` (this process reserves and
        commits the blocks); any failure is a 502 and nothing half-written stays."""
        from kvpool.serve.runtime.pipeline import pipeline_prefill

        pool = self.pool  # stages write into a cluster pool's reservations
        with self.fleet.lock:
            clients = [h.client for h in stages if h.client is not None]
            ready = len(clients) == len(stages) and all(h.alive for h in stages)
            if not isinstance(pool, RemotePool) or not ready:
                raise ApiError(503, f"pipeline group {group} is not available", "server_error")
            for h in stages:  # counts as queued work on every member (routing, /health)
                h.inflight[req.id] = req
        try:
            res = await run_in_threadpool(
                pipeline_prefill,
                pool,
                self.settings.model,
                clients,
                req.tokens,
                chunk_tokens=self.settings.chunk_tokens,
                request_id=req.id,
                seed=self.settings.seed,
                sampling=req.sampling,
            )
        except Exception as exc:
            self.metrics.pipeline_failures.labels(group).inc()
            raise ApiError(
                502, f"pipeline group {group} failed: {type(exc).__name__}: {exc}", "server_error"
            ) from None
        finally:
            with self.fleet.lock:
                for h in stages:
                    h.inflight.pop(req.id, None)
        result = res.to_dict()
        self.metrics.pipeline.labels(group).inc()
        self._account(req, result)
        return result

    def _first_token(self, req: ServeRequest, result: dict[str, Any]) -> bool:
        """Record the prefill's token; True if it already stops the request."""
        token = int(result["first_token"])
        now = time.perf_counter()
        req.output.append(token)
        req.logprobs.append(result.get("first_logprobs"))
        req.times.append(now)
        self.metrics.ttft.observe(now - req.arrival)
        self.metrics.generated.inc()
        assert req.stopper is not None
        return req.stopper.feed(token, last=req.max_tokens == 1)

    async def _submit_decode(
        self, req: ServeRequest, d: WorkerHandle, result: dict[str, Any]
    ) -> None:
        client = d.client
        with self.fleet.lock:
            if client is None or not d.alive:
                raise ApiError(503, f"decode worker {d.worker_id} is not available", "server_error")
            d.inflight[req.id] = req  # before submit: events may arrive before the reply
        try:
            fut = client.submit(
                "decode.submit",
                {
                    "handoff": result,
                    "max_new_tokens": req.max_tokens,
                    "eos_id": req.eos_id,
                    "sampling": req.sampling.to_dict(),
                },
            )
            await asyncio.wrap_future(fut)
        except KVPoolError as exc:
            with self.fleet.lock:
                d.inflight.pop(req.id, None)
            raise ApiError(
                502, f"decode worker {d.worker_id} failed: {exc}", "server_error"
            ) from None

    def _remove_tail(self, result: dict[str, Any]) -> None:
        tail = result.get("tail_key")
        if tail and self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.remove(tail)

    async def tokens(
        self, req: ServeRequest
    ) -> AsyncIterator[tuple[int, bool, TokenLogprobs | None]]:
        """(token, finished, logprobs) in order, the prefill's first token included;
        ApiError on failure."""
        try:
            yield req.output[0], req.finished, req.logprobs[0]
            while not req.finished:
                item = await req.queue.get()
                if item[0] == "err":
                    req.error = str(item[2])
                    raise ApiError(int(item[1]), str(item[2]), "server_error")
                _, token, index, finished, lp = item
                if index == 0:  # decode re-emits the prefill's token at admission
                    req.finished = finished
                    continue
                now = time.perf_counter()
                self.metrics.tbt.observe(now - req.times[-1])
                req.output.append(token)
                req.logprobs.append(lp)
                req.times.append(now)
                self.metrics.generated.inc()
                req.finished = finished
                assert req.stopper is not None
                if req.stopper.feed(token, last=finished) and not finished:
                    req.finished = True  # a stop token or string: the decode worker stops now
                    self._cancel(req)
                yield token, req.finished, lp
        finally:
            self._end(req)

    def _end(self, req: ServeRequest) -> None:
        self.metrics.inflight.dec()
        if not req.finished:  # client left or failed: stop decoding it
            self._cancel(req)
        else:
            self.metrics.e2e.observe(time.perf_counter() - req.arrival)
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

    def _cancel(self, req: ServeRequest) -> None:
        """Stop decoding ``req`` (its later events are dropped: it left ``inflight``)."""
        d = self.fleet.handles.get(req.decode_worker)
        if d is not None:
            with self.fleet.lock:
                known = d.inflight.pop(req.id, None) is not None
            if known and d.client is not None and d.alive:
                with contextlib.suppress(KVPoolError):
                    d.client.submit("decode.cancel", {"request_id": req.id})

    def _observe(self, obs: Observation) -> None:
        observe = getattr(self.router, "observe", None)
        if observe is not None:
            try:
                observe(obs)
            except Exception:
                log.exception("router.observe failed")
