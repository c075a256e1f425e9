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
import logging
import signal
import sys
from typing import Any

from kvpool.args import non_negative_int, pool_url_arg, port_arg, positive_int, size_arg
from kvpool.failures import run_command

log = logging.getLogger("kvpool.serve")


class _Stopped(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="tiny",
        help="model preset (tiny, llama2-7b, llama2-70b) or a Hugging Face Llama-family "
        "checkpoint directory (config.json, *.safetensors, tokenizer.json)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="weights seed")
    p.add_argument("--prefill", type=positive_int, default=1, help="prefill worker processes")
    p.add_argument("--decode", type=positive_int, default=1, help="decode worker processes")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address")
    p.add_argument(
        "--port",
        type=port_arg,
        default=None,
        help="HTTP port (default 8000; 0 and --demo: a free one)",
    )
    p.add_argument(
        "--pool", type=pool_url_arg, default=None, help="kvpool://HOST:PORT (default: start one)"
    )
    p.add_argument(
        "--dram",
        type=size_arg,
        default=None,
        help="DRAM of the node started without --pool (default 1GiB, 256MiB with --demo)",
    )
    p.add_argument(
        "--block-tokens", type=positive_int, default=None, help="pool block size (tokens)"
    )
    p.add_argument("--chunk-tokens", type=positive_int, default=512, help="prefill chunk (tokens)")
    p.add_argument(
        "--cpp-group",
        type=positive_int,
        default=1,
        metavar="K",
        help="prefill workers also form pipeline groups of K stages for long prompts (1: none)",
    )
    p.add_argument(
        "--cpp-min-tokens",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="prompts of at least N tokens go to a pipeline group (default 16384; the "
        "conductor counts tokens to compute and also pipelines prompts that miss the TTFT SLO)",
    )
    p.add_argument(
        "--kv-tokens", type=positive_int, default=32768, help="KV memory per decode worker"
    )
    p.add_argument("--page-tokens", type=positive_int, default=16, help="decode KV page (tokens)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="decode batch limit")
    p.add_argument("--max-tokens-limit", type=positive_int, default=4096, help="largest max_tokens")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker")
    p.add_argument(
        "--device", default="cpu", help="torch device of the workers (cpu, cuda, cuda:N)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="compute and KV dtype (default: the preset's, or the checkpoint's torch_dtype)",
    )
    p.add_argument("--router", default="least-loaded", help="routing policy (routing.ROUTERS)")
    p.add_argument(
        "--router-opt", action="append", default=[], metavar="KEY=VALUE", help="router option"
    )
    p.add_argument("--served-model-name", default=None, help="model id in the API")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (also $KVPOOL_SERVE_API_KEY; "
        "/health and /metrics stay open)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=size_arg,
        default=16 << 20,
        help="largest request body (default 16MiB; larger ones answer 413)",
    )
    p.add_argument("--no-restart", action="store_true", help="do not restart dead workers")
    p.add_argument("--demo", action="store_true", help="serve a short synthetic load and exit")
    p.add_argument("--demo-requests", type=positive_int, default=12)
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=sorted(logging.getLevelNamesMapping()),
        default="WARNING",
        metavar="LEVEL",
        help="logging level of this process and the workers (DEBUG, INFO, WARNING, ...)",
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="run prefill/decode workers and an OpenAI-compatible HTTP front end"
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """``kvpool-serve ARGS``: ``kvpool serve ARGS`` under its own name, failing the same way."""
    parser = argparse.ArgumentParser(prog="kvpool-serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_command("kvpool-serve", run, parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.prefill % args.cpp_group:
        raise ValueError(
            f"--prefill {args.prefill} is not a multiple of --cpp-group {args.cpp_group}"
        )
    if args.demo and args.api_key:
        raise ValueError("--demo sends its load without --api-key: use one or the other")
    from kvpool.serve.runtime.launcher import ServeRuntime

    runtime = ServeRuntime(args)  # checks the model and groups before anything starts
    state = {"stopping": False}

    def on_signal(_sig: int, _frame: Any) -> None:
        if not state["stopping"]:
            state["stopping"] = True
            raise _Stopped()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
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


if __name__ == "__main__":
    sys.exit(main())
