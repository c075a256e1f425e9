"""The decode worker's RPC service: a continuous-batching loop and its token events.

Requests are queued by ``decode.submit`` and admitted by the loop thread,
which steps the ``DecodeEngine`` and publishes each token event to the
connection that submitted the request; ``decode.events`` long-polls those
events. A connection that goes away cancels its requests. If a step fails,
every request in the engine fails with an error event (never a hang).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from kvpool.rpc.server import Connection, RpcServer
from kvpool.serve.runtime.prefill import PrefillResult
from kvpool.serve.runtime.sampling import SamplingParams
from kvpool.serve.runtime.worker_messages import CancelCall, DecodeSubmit, EventsCall, WorkerLoad

if TYPE_CHECKING:
    pass

log = logging.getLogger("kvpool.serve.runtime.workers")


class DecodeService:
    """Runs ``DecodeEngine.step`` in a loop; token events queue up per connection."""

    def __init__(self, engine: Any, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, int, int | None, SamplingParams]] = deque()
        self._owner: dict[str, int] = {}  # request id -> connection id
        self._outbox: dict[int, list[list[Any]]] = {}
        self._cancelled: set[str] = set()
        self._stop = False
        self.completed = 0
        self.failed = 0
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="kvpool-decode-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- RPC ---------------------------------------------------------------------

    def submit(self, call: DecodeSubmit, conn: Connection) -> dict[str, Any]:
        handoff = PrefillResult.from_dict(call.handoff)
        eng = self.engine
        if call.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        need = handoff.prompt_tokens + call.max_new_tokens - 1
        if need > eng.cfg.max_context:
            raise ValueError(f"{need} positions exceed the model's context {eng.cfg.max_context}")
        if eng.cache.pages_for(need) > eng.cache.num_pages:
            raise ValueError(f"request needs {need} KV positions; the decode cache holds fewer")
        with self._cond:
            if handoff.request_id in self._owner:
                raise ValueError(f"request {handoff.request_id} is already here")
            self._owner[handoff.request_id] = conn.id
            self._outbox.setdefault(conn.id, [])
            sampling = SamplingParams.from_dict(call.sampling)
            self._inbox.append((handoff, call.max_new_tokens, call.eos_id, sampling))
            self._cond.notify_all()
            return {"queued": len(self._inbox)}

    def events(self, call: EventsCall, conn: Connection) -> dict[str, Any]:
        deadline = time.monotonic() + max(0.0, min(call.wait_s, 30.0))
        with self._cond:
            while not self._outbox.get(conn.id) and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            out = self._outbox.get(conn.id) or []
            self._outbox[conn.id] = []
        return {"events": out}

    def cancel(self, call: CancelCall) -> dict[str, Any]:
        with self._cond:
            known = self._owner.pop(call.request_id, None) is not None
            if known:
                self._cancelled.add(call.request_id)
                self._cond.notify_all()
        return {"cancelled": known}

    def disconnected(self, conn: Connection) -> None:
        with self._cond:
            self._outbox.pop(conn.id, None)
            for rid in [r for r, c in self._owner.items() if c == conn.id]:
                del self._owner[rid]
                self._cancelled.add(rid)
            self._cond.notify_all()

    def load(self, _params: Any = None) -> WorkerLoad:
        eng = self.engine
        waiting = [*list(eng.waiting), *(r for r, _ in list(eng.loading))]
        with self._cond:
            inbox = list(self._inbox)
        cache = eng.cache
        return WorkerLoad(
            self.worker_id,
            "decode",
            queued_requests=len(waiting) + len(inbox),
            queued_tokens=sum(r.handoff.prompt_tokens + r.max_new_tokens for r in waiting)
            + sum(h.prompt_tokens + m for h, m, _, _ in inbox),
            running=len(eng.running),
            completed=self.completed,
            failed=self.failed,
            kv_free_tokens=cache.free_pages * cache.page_tokens,
            kv_capacity_tokens=cache.num_pages * cache.page_tokens,
            max_batch=eng.max_batch,
            steps=eng.steps,
            extra={"busy_s": self.busy_s},
        )

    def register(self, server: RpcServer) -> None:
        server.register("decode.submit", self.submit, request_type=DecodeSubmit, pass_conn=True)
        server.register("decode.events", self.events, request_type=EventsCall, pass_conn=True)
        server.register("decode.cancel", self.cancel, request_type=CancelCall)
        server.register("load", self.load, inline=True)
        server.on_disconnect(self.disconnected)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # -- the loop ----------------------------------------------------------------

    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                if self._stop:
                    return
                failed = self._take_inbox()
                self._drop_cancelled()
                if eng.idle and not failed:
                    self._cond.wait(0.5)
                    continue
            if failed:
                self._publish(failed)
            if eng.idle:
                continue
            start = time.perf_counter()
            try:
                events = [
                    [e.request_id, e.token, e.index, e.finished, e.error, e.logprobs]
                    for e in eng.step()
                ]
            except Exception as exc:  # the batch is lost; fail it, keep serving
                log.exception("decode step failed")
                events = self._fail_everything(exc)
            self.busy_s += time.perf_counter() - start
            self._publish(events)

    def _take_inbox(self) -> list[list[Any]]:
        failed = []
        while self._inbox:
            handoff, max_new, eos, sampling = self._inbox.popleft()
            try:
                self.engine.submit(handoff, max_new, eos_id=eos, sampling=sampling)
            except ValueError as exc:
                failed.append([handoff.request_id, -1, 0, True, f"ValueError: {exc}", None])
        return failed

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        self._cancelled -= self.engine.cancel(self._cancelled)
        # requests still loading are dropped once they join the batch;
        # forget ids that are nowhere (already finished)
        loading = {r.request_id for r, _ in self.engine.loading}
        self._cancelled &= loading

    def _fail_everything(self, exc: BaseException) -> list[list[Any]]:
        reqs = self.engine.abandon()
        msg = f"{type(exc).__name__}: {exc}"
        return [[r.request_id, -1, len(r.output), True, msg, None] for r in reqs]

    def _publish(self, events: list[list[Any]]) -> None:
        if not events:
            return
        with self._cond:
            for ev in events:
                rid, finished, error = ev[0], ev[3], ev[4]
                conn = self._owner.get(rid)
                if finished:
                    self._owner.pop(rid, None)
                    if error:
                        self.failed += 1
                    else:
                        self.completed += 1
                if conn is not None and conn in self._outbox:
                    self._outbox[conn].append(ev)
            self._cond.notify_all()
