"""The worker fleet: the front end's view of its prefill and decode processes.

One ``WorkerHandle`` per worker id. The fleet keeps an RPC client to each
live worker, a long-poll pump per decode worker that routes its token
events to their requests, a poller of every worker's reported load, and a
supervisor thread that marks dead workers down (failing their in-flight
requests with 502) and restarts them through ``launch`` (exponential backoff
for a worker that keeps dying soon after its start).

Pipeline groups (``ServeSettings.groups``): the fleet links each group's
stages into a chain (``link`` RPC, stage i to stage i+1). A group is *ready*
while every member is live and was linked in its current incarnation (its
``generation``); only then do its members carry ``WorkerState.group`` for
the router. The supervisor re-links a group once its members are back.

Invariant: a request is in ``handle.inflight`` of every worker holding it,
and is removed (under ``lock``) by whoever finishes or fails it first.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable

from kvpool.errors import KVPoolError
from kvpool.procs import Child
from kvpool.rpc.client import RpcClient
from kvpool.serve.runtime.http.metrics import ServeMetrics
from kvpool.serve.runtime.http.state import ServeSettings, WorkerHandle
from kvpool.serve.sched.router_api import DECODE, PREFILL, WorkerState

log = logging.getLogger("kvpool.serve")

#: ``launch(kind, worker_id)``: start a worker process and wait for its ready line.
Launcher = Callable[[str, str], Child]


class WorkerFleet:
    """Worker handles, their pumps and pollers, the supervisor and pipeline groups."""

    def __init__(
        self, settings: ServeSettings, launch: Launcher | None, metrics: ServeMetrics
    ) -> None:
        self.settings = settings
        self.launch = launch
        self.metrics = metrics
        self.handles: dict[str, WorkerHandle] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._group_of = {w: (g, i) for g, ms in settings.groups.items() for i, w in enumerate(ms)}
        self._linked: dict[str, tuple[int, ...]] = {}  # group -> member generations linked

    def add_worker(self, worker_id: str, kind: str, child: Child) -> None:
        handle = WorkerHandle(worker_id, kind)
        self.handles[worker_id] = handle
        self._attach(handle, child)

    def _attach(self, handle: WorkerHandle, child: Child) -> None:
        client = RpcClient(child.address, name="kvpool-serve", reconnect=False, timeout=10)
        with self.lock:
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
        return tuple(self.handles[w].generation for w in self.settings.groups[group])

    def group_ready(self, group: str) -> bool:
        members = [self.handles.get(w) for w in self.settings.groups[group]]
        return all(h is not None and h.alive for h in members) and self._linked.get(
            group
        ) == self._generations(group)

    def link_group(self, group: str) -> bool:
        """Connect each stage of ``group`` to the next; the group is ready on success."""
        gens = self._generations(group)
        members = [self.handles[w] for w in self.settings.groups[group]]
        try:
            for a, b in itertools.pairwise(members):
                if a.client is None or b.child is None or not (a.alive and b.alive):
                    return False
                a.client.call("link", {"address": b.child.address}, timeout=10)
        except KVPoolError as exc:
            log.warning("linking pipeline group %s failed: %s", group, exc)
            return False
        with self.lock:
            self._linked[group] = gens
        return True

    def start(self) -> None:
        for group in self.settings.groups:
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
        with self.lock:
            if handle.generation != generation or not handle.alive:
                return
            handle.alive, handle.broken = False, True
            failed = list(handle.inflight.values())
            handle.inflight.clear()
        log.warning("worker %s down: %s", handle.worker_id, reason)
        self.metrics.worker_failures.labels(handle.worker_id).inc()
        for req in failed:
            req.push(("err", 502, f"{handle.kind} worker {handle.worker_id} failed: {reason}"))

    def _pump(self, handle: WorkerHandle, client: RpcClient, generation: int) -> None:
        """Long-poll ``decode.events`` and route every event to its request."""
        while not self._stop.is_set() and handle.generation == generation:
            try:
                reply = client.call(
                    "decode.events",
                    {"wait_s": self.settings.events_wait_s},
                    timeout=self.settings.events_wait_s + 10,
                )
            except KVPoolError as exc:
                if not self._stop.is_set():
                    self._mark_down(handle, generation, str(exc))
                return
            for rid, token, index, finished, error, logprobs in reply["events"]:
                with self.lock:
                    req = handle.inflight.get(rid)
                    if req is not None and finished:
                        del handle.inflight[rid]
                if req is None:
                    continue
                if error:
                    req.push(("err", 500, f"decode failed: {error}"))
                else:
                    req.push(("tok", int(token), int(index), bool(finished), logprobs))

    def _supervise(self) -> None:
        """Mark dead workers down and restart them; a worker that keeps dying soon
        after its start is retried with exponential backoff (up to 30 s)."""
        while not self._stop.wait(0.2):
            for h in list(self.handles.values()):
                dead = h.child is not None and not h.child.alive()
                if dead and h.alive:
                    code = h.child.popen.returncode if h.child else None
                    self._mark_down(h, h.generation, f"process exited ({code})")
                if not (h.broken and self.settings.restart and self.launch) or self._stop.is_set():
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
                self.metrics.restarts.labels(h.worker_id).inc()
                self._attach(h, child)
                log.warning("worker %s restarted (pid %d)", h.worker_id, child.pid)
            for g in self.settings.groups:  # re-form groups whose members came back
                if not self.group_ready(g) and not self._stop.is_set():
                    members = [self.handles.get(w) for w in self.settings.groups[g]]
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
        ready = {g for g in self.settings.groups if self.group_ready(g)}
        with self.lock:
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
