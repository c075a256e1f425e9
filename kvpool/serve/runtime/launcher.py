"""The processes of one ``kvpool serve`` and their life: start, serve, demo, stop.

``ServeRuntime.start`` starts a master and a node (unless ``--pool`` names
a pool), then every worker (from this thread, then waits for them
together), the front end, and binds the HTTP socket; ``serve_forever`` or
``demo`` serve; ``close`` stops everything in order: the HTTP server, the
workers, the node and the master (SIGTERM, then SIGKILL after a timeout),
then unlinks any shared memory a child left behind. Every child is a
``kvpool.procs.Child`` (own process group, parent-death signal).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

import kvpool
from kvpool import procs
from kvpool.cluster.client.remote_pool import RemotePool
from kvpool.procs import Child, ChildStartError
from kvpool.rpc.frame import listen
from kvpool.serve.runtime.checkpoint.config import resolve_model
from kvpool.serve.runtime.http.frontend import Frontend
from kvpool.serve.runtime.http.load import format_result, run_load
from kvpool.serve.runtime.http.state import ServeSettings
from kvpool.serve.runtime.pipeline import split_layers
from kvpool.serve.sched.pipeline_model import DEFAULT_MIN_TOKENS
from kvpool.serve.sched.router_api import RouterContext
from kvpool.serve.sched.routing import make_router, parse_options


class ServeRuntime:
    """One ``kvpool serve``: its child processes, front end and HTTP server."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # a checkpoint is read and checked here, before any process starts
        self.model, self.checkpoint = resolve_model(
            args.model, block_tokens=args.block_tokens, dtype=args.dtype
        )
        self.infra: list[Child] = []  # master, node
        self.workers: list[Child] = []  # every worker process started
        self.pids: list[int] = []
        self.frontend: Frontend | None = None
        self.pool: RemotePool | None = None
        self.server: uvicorn.Server | None = None
        self.sock: socket.socket | None = None
        self.url = ""
        k = args.cpp_group
        if k > self.model.num_layers:
            raise ValueError(f"--cpp-group {k} exceeds the model's {self.model.num_layers} layers")
        # pipeline groups: p0..p(k-1) are stages 0..k-1 of g0, pk..p(2k-1) of g1, ...
        self.groups: dict[str, list[str]] = (
            {f"g{j}": [f"p{j * k + i}" for i in range(k)] for j in range(args.prefill // k)}
            if k > 1
            else {}
        )

    # -- startup -----------------------------------------------------------------

    def start(self) -> None:
        args = self.args
        t0 = time.perf_counter()
        if args.pool:
            self.pool_url = args.pool
        else:
            master = procs.spawn(
                "master",
                procs.kvpool_args(
                    "master", "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"
                ),
                timeout=30,
            )
            self._track(master)
            node = procs.spawn(
                "node",
                procs.kvpool_args(
                    "node",
                    "--master",
                    master.address,
                    "--dram",
                    str(args.dram) if args.dram else ("256MiB" if args.demo else "1GiB"),
                    "--heartbeat",
                    "0.5",
                    "--log-level",
                    "WARNING",
                ),
                timeout=30,
            )
            self._track(node)
            self.pool_url = f"kvpool://{master.address}"

        self.pool = kvpool.connect(self.pool_url)
        settings = ServeSettings(
            model=self.model,
            served_name=args.served_model_name or args.model,
            seed=args.seed,
            max_tokens_limit=args.max_tokens_limit,
            decode_kv_tokens=args.kv_tokens,
            page_tokens=args.page_tokens,
            restart=not args.no_restart,
            groups=self.groups,
            chunk_tokens=args.chunk_tokens,
            checkpoint=self.checkpoint,
            api_key=args.api_key or os.environ.get("KVPOOL_SERVE_API_KEY") or None,
            max_body_bytes=args.max_body_bytes,
        )
        self.settings = settings
        cpp_min = 0
        if self.groups:
            cpp_min = args.cpp_min_tokens if args.cpp_min_tokens is not None else DEFAULT_MIN_TOKENS
        router = make_router(
            args.router,
            RouterContext(
                self.model,
                self.pool_url,
                args.seed,
                parse_options(args.router_opt),
                cpp_min_tokens=cpp_min,
                chunk_tokens=args.chunk_tokens,
            ),
        )
        fe = self.frontend = Frontend(settings, router, self.launch, self.pool)
        ids = [("prefill", f"p{i}") for i in range(args.prefill)]
        ids += [("decode", f"d{i}") for i in range(args.decode)]
        # start every worker from this (main) thread, then wait for them together
        started = [(kind, wid, self.launch(kind, wid, wait=False)) for kind, wid in ids]
        errors = []
        for kind, wid, child in started:
            try:
                fe.add_worker(wid, kind, procs.wait_ready(child, 120))
            except Exception as exc:
                errors.append(f"{wid}: {exc}")
        if errors:
            raise ChildStartError("workers did not start: " + "; ".join(errors))
        fe.start()
        port = args.port if args.port is not None else (0 if args.demo else 8000)
        self.sock = listen(args.host, port)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.server = self._make_server(fe)
        print(
            f"kvpool serve ready on {self.url} (model {args.model}, prefill {args.prefill}, "
            f"decode {args.decode}, cpp groups {len(self.groups)} x {args.cpp_group}, "
            f"pool {self.pool_url}, router {args.router}, "
            f"started in {time.perf_counter() - t0:.1f} s)",
            flush=True,
        )

    def _track(self, child: Child) -> None:
        self.infra.append(child)
        self.pids.append(child.pid)

    def launch(self, kind: str, worker_id: str, wait: bool = True) -> Child:
        a = self.args
        cmd = [
            "-m",
            "kvpool.serve.runtime.workers",
            kind,
            "--pool",
            self.pool_url,
            "--worker-id",
            worker_id,
            "--model",
            a.model,
            "--seed",
            str(a.seed),
            "--threads",
            str(a.threads),
            "--device",
            a.device,
            "--log-level",
            a.log_level,
        ]
        if a.block_tokens:
            cmd += ["--block-tokens", str(a.block_tokens)]
        if a.dtype:
            cmd += ["--dtype", a.dtype]
        if kind == "prefill":
            cmd += ["--chunk-tokens", str(a.chunk_tokens)]
            if self.groups:
                i = int(worker_id[1:])
                first, last = split_layers(self.model.num_layers, a.cpp_group)[i % a.cpp_group]
                cmd += ["--stage", f"{first}:{last}"]
        else:
            cmd += [
                "--kv-tokens",
                str(a.kv_tokens),
                "--page-tokens",
                str(a.page_tokens),
                "--max-batch",
                str(a.max_batch),
            ]
        child = procs.start(worker_id, cmd)
        self.pids.append(child.pid)
        self.workers.append(child)
        return procs.wait_ready(child, 120) if wait else child

    @staticmethod
    def _make_server(frontend: Frontend) -> uvicorn.Server:
        config = uvicorn.Config(
            frontend.app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        return uvicorn.Server(config)

    # -- running -----------------------------------------------------------------

    def serve_forever(self) -> None:
        assert self.server is not None and self.sock is not None, "start() first"
        self.server.run(sockets=[self.sock])

    def demo(self) -> int:
        """Send a short synthetic load (prompts sharing a system prompt), print TTFT/TBT
        and the prefix hits; 0 if every request succeeded."""
        server = self.server
        assert server is not None and self.sock is not None, "start() first"
        thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        system = (
            "You are kvpool's demo assistant. Every request starts with this system prompt, "
            "so its blocks are computed once and then read from the pool. "
        ) * 10
        questions = [f"Question {i}: what is block {i} of the cache?" for i in range(64)]
        tok = self.settings.tokenizer()
        prompts = [tok.encode(system + q) for q in questions[: self.args.demo_requests]]
        first = run_load(self.url, concurrency=1, requests=1, max_tokens=32, prompts=prompts[:1])
        rest = run_load(
            self.url,
            concurrency=4,
            requests=len(prompts) - 1,
            max_tokens=32,
            prompts=prompts[1:],
        )
        bt = self.model.block_tokens
        print(f"demo: {len(prompts[0])}-token prompts sharing a system prompt, {bt}-token blocks")
        print("cold request (computes the whole prompt):")
        print(format_result(first))
        print("the rest, 4 at a time (the system prompt's blocks come from the pool):")
        print(format_result(rest))
        server.should_exit = True
        thread.join(timeout=10)
        return 0 if first.errors == 0 and rest.errors == 0 else 1

    # -- shutdown ----------------------------------------------------------------

    def close(self) -> None:
        t0 = time.perf_counter()

        if self.server is not None:
            self.server.should_exit = True
        fe = self.frontend
        if fe is not None:
            fe.close()
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda c: c.stop(5.0), fe.children()))
        for child in self.workers:  # any that never joined the front end (startup cut short)
            child.stop(2.0)
        if self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.close()
        for child in reversed(self.infra):  # node, then master
            child.stop(5.0)
        if self.sock is not None:
            self.sock.close()
        removed = procs.unlink_shm(self.pids)
        if removed:
            print(f"kvpool serve: unlinked shared memory left by children: {removed}", flush=True)
        print(f"kvpool serve stopped ({time.perf_counter() - t0:.1f} s)", flush=True)
