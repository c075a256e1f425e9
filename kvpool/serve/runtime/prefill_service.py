"""The prefill worker's RPC service: FIFO prefill on one compute thread.

RPC threads each wait for their own request; the compute thread runs one
prompt at a time in arrival order, so the queue the front end sees
(``load``) is exactly the work ahead of a new request.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvpool.rpc.server import RpcServer
from kvpool.serve.runtime.sampling import SamplingParams
from kvpool.serve.runtime.worker_messages import PrefillCall, WorkerLoad

if TYPE_CHECKING:
    pass


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
            result = self.worker.prefill(
                call.tokens,
                request_id=call.request_id,
                sampling=SamplingParams.from_dict(call.sampling),
            )
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
