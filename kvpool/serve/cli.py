"""``kvpool serve`` (also installed as ``kvpool-serve``): the whole runtime in one command.

Process layout (every child in its own process group, with a parent-death
signal, so nothing outlives this process):

    kvpool serve (this process: HTTP front end, router, supervisor)
      +- kvpool master            (only without --pool)
      +- kvpool node --dram SIZE  (only without --pool)
      +- python -m kvpool.serve.runtime.workers prefill --worker-id p0 ... (x --prefill)
         (with --cpp-group k also --stage A:B: p0..p(k-1) form pipeline group g0, ...)
      +- python -m kvpool.serve.runtime.workers decode  --worker-id d0 ... (x --decode)

Prints ``kvpool serve ready on http://HOST:PORT ...`` once it answers. Stops
on SIGINT/SIGTERM: the HTTP server first, then the workers, the node and the
master (SIGTERM, then SIGKILL after a timeout), then unlinks any shared
memory a child left behind. ``--demo`` starts everything on a free port,
sends a short synthetic workload (prompts sharing a system prompt), prints
TTFT/TBT and the prefix hits, and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.rpc.frame import listen

log = logging.getLogger("kvpool.serve")


class _Stopped(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="model preset: tiny, llama2-7b, llama2-70b")
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.add_argument("--prefill", type=int, default=1, help="prefill worker processes")
    p.add_argument("--decode", type=int, default=1, help="decode worker processes")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address")
    p.add_argument(
        "--port", type=int, default=None, help="HTTP port (default 8000; 0 and --demo: a free one)"
    )
    p.add_argument("--pool", default=None, help="kvpool://HOST:PORT (default: start one)")
    p.add_argument(
        "--dram",
        default=None,
        help="DRAM of the node started without --pool (default 1GiB, 256MiB with --demo)",
    )
    p.add_argument("--block-tokens", type=int, default=None, help="pool block size (tokens)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument(
        "--cpp-group",
        type=int,
        default=1,
        metavar="K",
        help="prefill workers also form pipeline groups of K stages for long prompts (1: none)",
    )
    p.add_argument(
        "--cpp-min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompts of at least N tokens go to a pipeline group (default 16384; the "
        "conductor counts tokens to compute and also pipelines prompts that miss the TTFT SLO)",
    )
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV memory per decode worker")
    p.add_argument("--page-tokens", type=int, default=16, help="decode KV page (tokens)")
    p.add_argument("--max-batch", type=int, default=32, help="decode batch limit")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--device", default="cpu", help="torch device of the workers")
    p.add_argument("--router", default="least-loaded", help="routing policy (routing.ROUTERS)")
    p.add_argument(
        "--router-opt", action="append", default=[], metavar="KEY=VALUE", help="router option"
    )
    p.add_argument("--served-model-name", default=None, help="model id in the API")
    p.add_argument("--no-restart", action="store_true", help="do not restart dead workers")
    p.add_argument("--demo", action="store_true", help="serve a short synthetic load and exit")
    p.add_argument("--demo-requests", type=int, default=12)
    p.add_argument("--log-level", default="WARNING")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="run prefill/decode workers and an OpenAI-compatible HTTP front end"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool-serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.prefill < 1 or args.decode < 1:
        raise SystemExit("--prefill and --decode must be at least 1")
    if args.cpp_group < 1 or args.prefill % args.cpp_group:
        raise SystemExit(
            f"--prefill {args.prefill} is not a multiple of --cpp-group {args.cpp_group}"
        )
    state = {"stopping": False}

    def on_signal(_sig: int, _frame: Any) -> None:
        if not state["stopping"]:
            state["stopping"] = True
            raise _Stopped()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    runtime = _Runtime(args)
    try:
        runtime.start()
        if args.demo:
            return runtime.demo()
        runtime.serve_forever()
        return 0
    except _Stopped:
        return 0
    finally:
        state["stopping"] = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        runtime.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)


class _Runtime:
    def __init__(self, args: argparse.Namespace) -> None:
        from kvpool.serve.sched.presets import get_preset

        self.args = args
        self.model = get_preset(args.model, block_tokens=args.block_tokens)
        self.infra: list[Any] = []  # master, node (Child)
        self.workers: list[Any] = []  # every worker process started (Child)
        self.pids: list[int] = []
        self.frontend: Any = None
        self.pool: Any = None
        self.server: Any = None
        self.sock: socket.socket | None = None
        self.url = ""
        k = args.cpp_group
        if k > self.model.num_layers:
            raise SystemExit(f"--cpp-group {k} exceeds the model's {self.model.num_layers} layers")
        # pipeline groups: p0..p(k-1) are stages 0..k-1 of g0, pk..p(2k-1) of g1, ...
        self.groups: dict[str, list[str]] = (
            {f"g{j}": [f"p{j * k + i}" for i in range(k)] for j in range(args.prefill // k)}
            if k > 1
            else {}
        )

    # -- startup -----------------------------------------------------------------

    def start(self) -> None:
        from kvpool import procs

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
                    args.dram or ("256MiB" if args.demo else "1GiB"),
                    "--heartbeat",
                    "0.5",
                    "--log-level",
                    "WARNING",
                ),
                timeout=30,
            )
            self._track(node)
            self.pool_url = f"kvpool://{master.address}"
        import kvpool
        from kvpool.serve.runtime.http.frontend import Frontend
        from kvpool.serve.runtime.http.state import ServeSettings
        from kvpool.serve.sched.router_api import RouterContext
        from kvpool.serve.sched.routing import make_router, parse_options

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
        )
        cpp_min = 0
        if self.groups:
            from kvpool.serve.sched.pipeline_model import DEFAULT_MIN_TOKENS

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
            raise RuntimeError("workers did not start: " + "; ".join(errors))
        fe.start()
        port = args.port if args.port is not None else (0 if args.demo else 8000)
        self.sock = listen(args.host, port)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._make_server()
        print(
            f"kvpool serve ready on {self.url} (model {args.model}, prefill {args.prefill}, "
            f"decode {args.decode}, cpp groups {len(self.groups)} x {args.cpp_group}, "
            f"pool {self.pool_url}, router {args.router}, "
            f"started in {time.perf_counter() - t0:.1f} s)",
            flush=True,
        )

    def _track(self, child: Any) -> None:
        self.infra.append(child)
        self.pids.append(child.pid)

    def launch(self, kind: str, worker_id: str, wait: bool = True) -> Any:
        from kvpool import procs

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
        if kind == "prefill":
            cmd += ["--chunk-tokens", str(a.chunk_tokens)]
            if self.groups:
                from kvpool.serve.runtime.pipeline import split_layers

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

    def _make_server(self) -> None:
        import uvicorn

        config = uvicorn.Config(
            self.frontend.app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)

    # -- running -----------------------------------------------------------------

    def serve_forever(self) -> None:
        assert self.sock is not None
        self.server.run(sockets=[self.sock])

    def demo(self) -> int:
        from kvpool.bench.serve import format_result, run_load
        from kvpool.serve.runtime.tokenizer import ByteTokenizer

        assert self.sock is not None
        thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        thread.start()
        while not self.server.started:
            time.sleep(0.02)
        system = (
            "You are kvpool's demo assistant. Every request starts with this system prompt, "
            "so its blocks are computed once and then read from the pool. "
        ) * 10
        questions = [f"Question {i}: what is block {i} of the cache?" for i in range(64)]
        tok = ByteTokenizer()
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
        self.server.should_exit = True
        thread.join(timeout=10)
        return 0 if first.errors == 0 and rest.errors == 0 else 1

    # -- shutdown ----------------------------------------------------------------

    def close(self) -> None:
        from kvpool import procs

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


if __name__ == "__main__":
    sys.exit(main())
