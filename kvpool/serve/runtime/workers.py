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
  finished, error, logprobs], ...]}`` (``logprobs``: ``[logprob, [[id, logprob],
  ...]]`` when the request asked, else null): a long poll: every token event of requests this
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
import sys
import threading
from typing import Any

from kvpool.rpc.server import RpcServer, ServerConfig
from kvpool.serve.runtime.decode_service import DecodeService
from kvpool.serve.runtime.prefill_service import PrefillService
from kvpool.stop_signals import StopSignals

log = logging.getLogger("kvpool.serve.runtime.workers")


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
    stops = StopSignals()
    threading.Thread(target=_watch_parent, args=(stops.event,), daemon=True).start()

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
        stops.wait()
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
