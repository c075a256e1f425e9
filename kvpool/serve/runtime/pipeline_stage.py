"""One stage of a chunked-pipeline-parallel (CPP) prefill group: a worker process.

``python -m kvpool.serve.runtime.pipeline_stage --pool kvpool://HOST:PORT --layers A:B ...``
builds only layers ``[A, B)`` of the model (exactly the full model's weights
for them, see ``kvpool.serve.runtime.model``), connects to the pool, serves an
``RpcServer`` and prints ``kvpool cpp stage ready on HOST:PORT``.

RPC methods (driven by ``kvpool.serve.runtime.pipeline.CppGroup``):

- ``link {address}``: connect to the next stage (the last stage has none);
- ``begin {...}``: a request — its tokens, chunk size, cached prefix, and the
  block writes to do: per block (or tail block) its key, first row, rows and
  the placements the coordinator reserved (``[[alloc_id, node_id, offset],
  ...]``) plus the nodes' ``RegionInfo``. The first stage starts the chunk
  loop at once; the others wait for chunks;
- ``chunk {rid, start, end, h}`` (inline, so chunks stay in order): the hidden
  states of positions ``[start, end)`` from the previous stage;
- ``result {rid}``: waits until this stage ran every chunk and its layers'
  bytes are in the reserved blocks; returns timings (and, from the last
  stage, the first output token).

Each stage writes only its own layers' byte ranges of each block
(``RemotePool.adopt`` of the coordinator's exported reservations); the
coordinator commits a block once every stage reported, so a block still
becomes visible only with all of its layers, and decode loads it exactly as
after a single-worker prefill. Activations travel stage to stage over the
RPC connection (msgpack frames, raw bytes), never through the master.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvpool.api import BlockWriter
from kvpool.cluster.client.handles import RemoteBlockWriter, ReservationTicket
from kvpool.cluster.client.remote_pool import RemotePool
from kvpool.rpc import RpcClient, RpcServer, ServerConfig
from kvpool.serve.runtime.model import Transformer, build_model
from kvpool.serve.runtime.sampling import (
    GREEDY,
    SamplingParams,
    TokenLogprobs,
    sample,
    token_logprobs,
)
from kvpool.stop_signals import StopSignals

READY_PREFIX = "kvpool cpp stage ready on"
MAX_FRAME = 256 * 1024 * 1024
DEFAULT_TTL_S = 30.0  # when the coordinator names no deadline


@dataclass
class _Write:
    """One block (or tail block) this stage fills its layers of."""

    start: int  # first token row
    rows: int
    writer: RemoteBlockWriter
    written: bool = False


@dataclass
class _Request:
    rid: str
    ids: Tensor | None
    total: int
    cached: int
    chunk: int
    writes: list[_Write]
    kv: dict[int, tuple[Tensor, Tensor]]
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    first_token: int | None = None
    first_logprobs: TokenLogprobs | None = None
    sampling: SamplingParams = GREEDY  # how the last stage picks the first token
    busy_s: float = 0.0
    t_first: float = 0.0  # wall clock (time.time) when the first chunk started here
    t_last: float = 0.0  # ... and when the last chunk finished
    chunks: int = 0
    copies: list[Future[None]] = field(default_factory=list)
    sends: list[Future[Any]] = field(default_factory=list)


class Stage:
    """A pipeline stage: layers ``[first, last)`` of ``model`` plus the pool it writes to."""

    def __init__(self, model: Transformer, pool: RemotePool, first: int, last: int) -> None:
        self.model, self.pool = model, pool
        self.first, self.last = first, last
        self.is_first = first == 0
        self.is_last = last == model.cfg.num_layers
        self.next: RpcClient | None = None
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvpool-cpp-store")
        self._thread = threading.Thread(target=self._loop, name="kvpool-cpp-stage", daemon=True)
        self._thread.start()

    def _adopt(self, write: dict[str, Any], nodes: dict[str, Any]) -> RemoteBlockWriter:
        """A writer onto the coordinator's reservation for one ``begin`` write. Its
        ``ttl_s`` (seconds left before the master revokes it) is re-based on this
        process's clock by ``adopt``, since monotonic clocks are per host."""
        cfg = self.model.cfg
        allocations = [(int(a), str(n), int(o)) for a, n, o in write["alloc"]]
        ttl = write.get("ttl_s")
        ticket = ReservationTicket(
            key=write["key"],
            size=2 * write["rows"] * cfg.num_layers * cfg.kv_dim * cfg.dtype_bytes,
            allocations=allocations,
            ttl_s=DEFAULT_TTL_S if ttl is None else float(ttl),
            nodes={n: nodes[n] for _, n, _ in allocations},
            epoch=int(write.get("epoch", 0)),
            parent=write.get("parent"),
        )
        return self.pool.adopt(ticket)

    # -- RPC handlers -----------------------------------------------------------

    def link(self, params: dict[str, Any]) -> bool:
        if self.next is not None:
            self.next.close()
        host, port = params["address"].rsplit(":", 1)
        self.next = RpcClient((host, int(port)), timeout=60.0, max_frame=MAX_FRAME)
        return True

    def begin(self, params: dict[str, Any]) -> bool:
        total, cfg = int(params["total"]), self.model.cfg
        shape = (total, cfg.num_kv_heads, cfg.head_dim)
        dt = self.model.dtype
        kv = {
            layer: (torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt))
            for layer in range(self.first, self.last)
        }
        writes = []
        for w in params["writes"]:
            writes.append(_Write(w["start"], w["rows"], self._adopt(w, params["nodes"])))
        tokens = params.get("tokens")
        ids_t = None if tokens is None else torch.from_numpy(np.frombuffer(tokens, "<i4").copy())
        req = _Request(
            rid=params["rid"],
            ids=None if ids_t is None else ids_t.long(),
            total=total,
            cached=int(params["cached"]),
            chunk=int(params["chunk"]),
            writes=writes,
            kv=kv,
            sampling=SamplingParams.from_dict(params.get("sampling")),
        )
        self._load_cached(req, list(params.get("cached_keys", [])))
        with self._lock:
            self._requests[req.rid] = req
        if self.is_first:
            self._work.put(("run", req.rid))
        return True

    def chunk(self, params: dict[str, Any]) -> bool:
        self._work.put(("chunk", params))
        return True

    def result(self, params: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            req = self._requests.get(params["rid"])
        if req is None:
            raise KeyError(f"unknown request {params['rid']!r}")
        if not req.done.wait(float(params.get("timeout", 600.0))):
            raise TimeoutError(f"stage [{self.first}, {self.last}) timed out")
        with self._lock:
            self._requests.pop(req.rid, None)
        return {
            "error": req.error,
            "first_token": req.first_token,
            "first_logprobs": req.first_logprobs,
            "busy_s": req.busy_s,
            "t_first": req.t_first,
            "t_last": req.t_last,
            "chunks": req.chunks,
            "layers": [self.first, self.last],
        }

    # -- work ---------------------------------------------------------------------

    def _load_cached(self, req: _Request, keys: list[bytes]) -> None:
        """This stage's layers of the cached prefix blocks, straight into its KV buffers."""
        lay = self.model.cfg.kv_layout()
        bt, half = lay.block_tokens, lay.half_layer_bytes
        for layer, (k_buf, v_buf) in req.kv.items():  # a layer: one batch read
            pieces, offsets, lengths = lay.layer_reads(layer, keys)
            outs = [
                buf[i * bt : (i + 1) * bt].reshape(-1).view(torch.uint8)
                for i in range(len(keys))
                for buf in (k_buf, v_buf)
            ]
            got = self.pool.get_into_batch(pieces, outs, offsets=offsets, lengths=lengths)
            for key, took in zip(pieces, got, strict=True):
                if took != half:
                    raise RuntimeError(f"cached block {key.hex()} vanished")

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            kind, arg = self._work.get()
            if kind == "stop":
                return
            if kind == "run":
                self._run_all(arg)
                continue
            params = arg
            with self._lock:
                found = self._requests.get(params["rid"])
            if found is None or found.error:
                continue
            try:
                dim = self.model.cfg.hidden_size
                h = torch.frombuffer(bytearray(params["h"]), dtype=self.model.dtype).view(-1, dim)
                self._step(found, int(params["start"]), int(params["end"]), h)
            except BaseException as exc:
                self._fail(found, exc)

    def _run_all(self, rid: str) -> None:
        """First stage: embed and run every chunk of the request."""
        with self._lock:
            req = self._requests[rid]
        start = req.cached
        try:
            while start < req.total and not req.error:
                end = min(start + req.chunk, req.total)
                assert req.ids is not None
                self._step(req, start, end, self.model.embed(req.ids[start:end]))
                start = end
        except BaseException as exc:  # reported by result()
            self._fail(req, exc)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        req.error = f"{type(exc).__name__}: {exc}"
        if self.next is not None:
            # let later stages finish (with the error) instead of waiting forever;
            # the next stage may be the one that died
            with contextlib.suppress(Exception):
                self.next.submit("abort", {"rid": req.rid, "error": req.error})
        req.done.set()

    def abort(self, params: dict[str, Any]) -> bool:
        with self._lock:
            req = self._requests.get(params["rid"])
        if req is not None and not req.done.is_set():
            req.error = req.error or f"an earlier stage failed: {params['error']}"
            if self.next is not None:
                with contextlib.suppress(Exception):
                    self.next.submit("abort", params)
            req.done.set()
        return True

    @torch.inference_mode()
    def _step(self, req: _Request, start: int, end: int, h: Tensor) -> None:
        t0 = time.perf_counter()
        if req.chunks == 0:
            req.t_first = time.time()
        ready = [w for w in req.writes if not w.written and w.start + w.rows <= end]
        for w in ready:
            w.written = True
        for layer in range(self.first, self.last):
            k_buf, v_buf = req.kv[layer]
            h = self.model.run_layer(layer, h, start, k_buf, v_buf)
            if ready:
                req.copies.append(self._copier.submit(self._store, layer, k_buf, v_buf, ready))
        req.chunks += 1
        last_chunk = end == req.total
        if self.is_last:
            if last_chunk:
                logits = self.model.logits(h[-1])
                req.first_token = sample(logits, req.sampling, 0)
                if req.sampling.logprobs is not None:
                    req.first_logprobs = token_logprobs(
                        logits, req.first_token, req.sampling.logprobs
                    )
        else:
            assert self.next is not None
            payload = {
                "rid": req.rid,
                "start": start,
                "end": end,
                "h": h.contiguous().numpy().tobytes(),
            }
            req.sends.append(self.next.submit("chunk", payload))
        req.busy_s += time.perf_counter() - t0
        if last_chunk:
            for fut in req.copies:
                fut.result()
            for fut in req.sends:
                fut.result()
            req.t_last = time.time()
            req.done.set()

    def _store(self, layer: int, k_buf: Tensor, v_buf: Tensor, writes: list[_Write]) -> None:
        cfg = self.model.cfg
        row_bytes = cfg.kv_dim * cfg.dtype_bytes
        pieces: list[tuple[BlockWriter, int, Tensor]] = []
        for w in writes:
            half = w.rows * row_bytes
            base = layer * 2 * half
            k = k_buf[w.start : w.start + w.rows].reshape(-1).view(torch.uint8)
            v = v_buf[w.start : w.start + w.rows].reshape(-1).view(torch.uint8)
            pieces += [(w.writer, base, k), (w.writer, base + half, v)]
        BlockWriter.write_pieces(pieces)  # the layer's pieces: one exchange per node

    def register(self, server: RpcServer) -> None:
        """The stage's RPC methods (also served by a ``kvpool serve`` prefill worker
        that is a stage of a pipeline group)."""
        server.register("link", self.link)
        server.register("begin", self.begin)
        server.register("chunk", self.chunk, inline=True)
        server.register("abort", self.abort, inline=True)
        server.register("result", self.result)

    def close(self) -> None:
        self._work.put(("stop", None))
        self._copier.shutdown(wait=True)
        if self.next is not None:
            self.next.close()


def parse_layers(text: str) -> tuple[int, int]:
    a, b = text.split(":", 1)
    return int(a), int(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvpool.serve.runtime.pipeline_stage", description=__doc__
    )
    p.add_argument("--pool", required=True, help="kvpool://HOST:PORT of the pool's master")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=None)
    p.add_argument("--layers", required=True, help="A:B, the layer range [A, B) of this stage")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import kvpool

    first, last = parse_layers(args.layers)
    model = build_model(
        args.preset, args.seed, block_tokens=args.block_tokens, layers=range(first, last)
    )
    pool = kvpool.connect(args.pool, timeout=30.0)
    stage = Stage(model, pool, first, last)
    server = RpcServer(ServerConfig(host=args.host, port=args.port, max_frame=MAX_FRAME))
    stage.register(server)
    stops = StopSignals()
    host, port = server.start()
    print(f"{READY_PREFIX} {host}:{port}", flush=True)
    try:
        stops.wait()
    finally:
        stage.close()
        server.close()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
