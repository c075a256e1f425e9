"""Prefill and decode worker processes: a model, a pool connection and an RPC server.

Run one with::

    python -m kvpool.serve.runtime.workers prefill --pool kvpool://HOST:PORT --worker-id p0
    python -m kvpool.serve.runtime.workers decode  --pool kvpool://HOST:PORT --worker-id d0

(``kvpool serve`` starts them). Each prints one ready line,
``kvpool <kind> worker <id> ready on HOST:PORT (pid N)``, and serves msgpack
RPC (``kvpool.rpc.server``; no pickle) until SIGINT/SIGTERM or until its
parent process dies.

Prefill worker methods:

- ``prefill.run`` ``PrefillCall(request_id, tokens)`` -> ``PrefillResult.to_dict()``
  (``timings["queue_s"]`` added). Requests run one at a time in arrival
  order on one compute thread; the call returns when the prompt's KV is in
  the pool.

Decode worker methods (every reply goes to the connection that asked):

- ``decode.submit`` ``DecodeSubmit(handoff, max_new_tokens, eos_id)`` -> ``{"queued": n}``:
  queues a prefilled request for the continuous-batching loop (checked
  first: a request that can never fit is refused with an error reply);
- ``decode.events`` ``EventsCall(wait_s)`` -> ``{"events": [[rid, token, index,
  finished, error], ...]}``: a long poll: every token event of requests this
  connection submitted, waiting up to ``wait_s`` for the first one. The
  front end keeps one such call outstanding per decode worker, so tokens
  stream back as the loop emits them;
- ``decode.cancel`` ``{"request_id": rid}``: drop a request (its client left).

Both kinds answer ``load`` (their queue and batch, for routing) and ``info``.

A prefill worker started with ``--stage A:B`` is also stage ``[A, B)`` of a
pipeline group (``kvpool serve --cpp-group k``): it serves the stage methods
of ``kvpool.serve.runtime.pipeline_stage.Stage`` (``link``, ``begin``, ``chunk``,
``abort``, ``result``) on the same RPC server, with its full model, so it
prefills short prompts alone and long ones as one stage of the pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpool.rpc.messages import WireMessage
from kvpool.rpc.server import Connection, RpcServer, ServerConfig

log = logging.getLogger("kvpool.serve.runtime.workers")


@dataclass
class PrefillCall(WireMessage):
    request_id: str
    tokens: list[int]


@dataclass
class DecodeSubmit(WireMessage):
    handoff: dict[str, Any]
    max_new_tokens: int
    eos_id: int | None = None


@dataclass
class EventsCall(WireMessage):
    wait_s: float = 1.0


@dataclass
class CancelCall(WireMessage):
    request_id: str


@dataclass
class WorkerLoad(WireMessage):
    """What ``load`` answers (see ``kvpool.serve.sched.routing.WorkerState``)."""

    worker_id: str
    kind: str
    queued_requests: int = 0
    queued_tokens: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0
    kv_free_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    max_batch: int | None = None
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class PrefillService:
    """FIFO prefill on one compute thread; RPC threads wait for their request."""

    def __init__(self, worker: Any, worker_id: str) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="kvpool-prefill")
        self._lock = threading.Lock()
        self.queued = 0
        self.queued_tokens = 0
        self.running = 0
        self.completed = 0
        self.failed = 0
        self.busy_s = 0.0

    def run(self, call: PrefillCall) -> dict[str, Any]:
        n = len(call.tokens)
        with self._lock:
            self.queued += 1
            self.queued_tokens += n
        enqueued = time.perf_counter()
        return self._exec.submit(self._prefill, call, enqueued).result()

    def _prefill(self, call: PrefillCall, enqueued: float) -> dict[str, Any]:
        n = len(call.tokens)
        with self._lock:
            self.queued -= 1
            self.queued_tokens -= n
            self.running = 1
        start = time.perf_counter()
        try:
            result = self.worker.prefill(call.tokens, request_id=call.request_id)
        except Exception:
            with self._lock:
                self.failed += 1
            raise
        finally:
            with self._lock:
                self.running = 0
                self.busy_s += time.perf_counter() - start
        with self._lock:
            self.completed += 1
        out = result.to_dict()
        out["timings"]["queue_s"] = start - enqueued
        return out

    def load(self, _params: Any = None) -> WorkerLoad:
        with self._lock:
            return WorkerLoad(
                self.worker_id,
                "prefill",
                queued_requests=self.queued,
                queued_tokens=self.queued_tokens,
                running=self.running,
                completed=self.completed,
                failed=self.failed,
                extra={"busy_s": self.busy_s},
            )

    def register(self, server: RpcServer) -> None:
        server.register("prefill.run", self.run, request_type=PrefillCall)
        server.register("load", self.load, inline=True)

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)


class DecodeService:
    """Runs ``DecodeEngine.step`` in a loop; token events queue up per connection."""

    def __init__(self, engine: Any, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, int, int | None]] = deque()
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
        from kvpool.serve.runtime.prefill import PrefillResult

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
            self._inbox.append((handoff, call.max_new_tokens, call.eos_id))
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
            + sum(h.prompt_tokens + m for h, m, _ in inbox),
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
                events = [[e.request_id, e.token, e.index, e.finished, e.error] for e in eng.step()]
            except Exception as exc:  # the batch is lost; fail it, keep serving
                log.exception("decode step failed")
                events = self._fail_everything(exc)
            self.busy_s += time.perf_counter() - start
            self._publish(events)

    def _take_inbox(self) -> list[list[Any]]:
        failed = []
        while self._inbox:
            handoff, max_new, eos = self._inbox.popleft()
            try:
                self.engine.submit(handoff, max_new, eos_id=eos)
            except ValueError as exc:
                failed.append([handoff.request_id, -1, 0, True, f"ValueError: {exc}"])
        return failed

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        eng = self.engine
        for req in [r for r in eng.waiting if r.request_id in self._cancelled]:
            eng.waiting.remove(req)
            eng._drop_tail(req.handoff)
            self._cancelled.discard(req.request_id)
        for req in [r for r in eng.running if r.request_id in self._cancelled]:
            eng.running.remove(req)
            eng._finish(req)
            self._cancelled.discard(req.request_id)
        # requests still loading are dropped once they join the batch;
        # forget ids that are nowhere (already finished)
        loading = {r.request_id for r, _ in eng.loading}
        self._cancelled &= loading

    def _fail_everything(self, exc: BaseException) -> list[list[Any]]:
        eng = self.engine
        reqs = [*eng.running, *eng.waiting]
        eng.running, eng.waiting = [], deque()
        for req in reqs:
            eng._finish(req)
        msg = f"{type(exc).__name__}: {exc}"
        return [[r.request_id, -1, len(r.output), True, msg] for r in reqs]

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


def _watch_parent(stop: threading.Event) -> None:
    parent = os.getppid()
    while not stop.wait(0.5):
        if os.getppid() != parent:
            log.warning("parent process %d is gone; stopping", parent)
            stop.set()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvpool.serve.runtime.workers")
    p.add_argument("kind", choices=["prefill", "decode"])
    p.add_argument("--pool", required=True, help="kvpool://HOST:PORT of the pool's master")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk size")
    p.add_argument(
        "--stage", default=None, metavar="A:B", help="prefill: also pipeline stage [A, B)"
    )
    p.add_argument("--kv-tokens", type=int, default=32768, help="decode KV memory (tokens)")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.worker_id} %(name)s %(levelname)s %(message)s",
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=_watch_parent, args=(stop,), daemon=True).start()

    import torch

    import kvpool
    from kvpool.serve.runtime.model import build_model

    torch.set_num_threads(max(1, args.threads))
    model = build_model(
        args.model,
        args.seed,
        device=args.device,
        dtype=args.dtype,
        block_tokens=args.block_tokens,
    )
    pool = kvpool.connect(args.pool)
    service: PrefillService | DecodeService
    closers: list[Any] = []
    stage: Any = None
    if args.kind == "prefill":
        from kvpool.serve.runtime.prefill import PrefillWorker

        pw = PrefillWorker(model, pool, chunk_tokens=args.chunk_tokens)
        closers.append(pw)
        service = PrefillService(pw, args.worker_id)
        if args.stage:
            from kvpool.serve.runtime.pipeline_stage import Stage, parse_layers

            first, last = parse_layers(args.stage)
            stage = Stage(model, pool, first, last)
            closers.append(stage)
    else:
        from kvpool.serve.runtime.decode import DecodeEngine

        pages = max(1, -(-args.kv_tokens // args.page_tokens))
        engine = DecodeEngine(
            model, pool, num_pages=pages, page_tokens=args.page_tokens, max_batch=args.max_batch
        )
        closers.append(engine)
        service = DecodeService(engine, args.worker_id)
        service.start()
    config = ServerConfig(host=args.host, port=args.port, name=f"kvpool-{args.kind}", workers=64)
    if stage is not None:
        from kvpool.serve.runtime.pipeline_stage import MAX_FRAME

        config.max_frame = MAX_FRAME  # a previous stage's hidden states
    server = RpcServer(config)
    service.register(server)
    if stage is not None:
        stage.register(server)
    server.register(
        "info",
        lambda _p: {
            "worker_id": args.worker_id,
            "kind": args.kind,
            "model": args.model,
            "block_tokens": model.cfg.block_tokens,
            "pid": os.getpid(),
            "stage": args.stage,
        },
        inline=True,
    )
    host, port = server.start()
    print(
        f"kvpool {args.kind} worker {args.worker_id} ready on {host}:{port} (pid {os.getpid()})",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
        service.close()
        for c in closers:
            with contextlib.suppress(Exception):
                c.close()
        with contextlib.suppress(Exception):
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
