"""``kvpool bench serve --checkpoint``: kvpool serve against its peers on one real checkpoint.

On one Hugging Face checkpoint (a directory, or ``tiny``: the benchmarks'
tiny Llama written by ``kvpool.bench.tiny_checkpoint`` into a temporary
directory), the same token-id prompts go to each peer:

- ``kvpool``: ``kvpool serve --model PATH`` with 1 prefill and 1 decode
  worker (streaming HTTP, ``kvpool.serve.runtime.http.load``);
- ``transformers``: ``generate`` in this process (greedy, a batch of
  ``concurrency`` prompts at a time, all the same length: no padding); the
  first token's time comes from a streamer. Needs ``transformers`` (the dev
  extra); the rows are skipped with the reason when it is absent;
- ``vllm``: vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``,
  prefix caching on) run by ``--vllm-python`` (default the engine venv,
  ``bash .ci/engine-env``); skipped with the reason when that python has no
  vLLM or the server does not start.

Two kinds of prompt, ``--requests`` of each per level and round: ``cold``
(every prompt new: ``--prefix`` + ``--unique`` fresh tokens) and ``prefix``
(one shared ``--prefix``-token prefix, put into each peer's cache by a
warm-up request before any measurement, + ``--unique`` fresh tokens:
kvpool finds it in the pool, vLLM in its prefix cache, transformers has no
cache and recomputes it). Each request asks for ``--max-tokens`` tokens
(``ignore_eos``). Levels: ``--levels`` concurrencies (client tasks; for
transformers the batch size).

Peers are started one after the other and only one is measured at a time
(the others idle), in rounds that interleave the peers (``--rounds``); each
row is the median over rounds of TTFT p50 and output tokens/s.
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvpool import procs
from kvpool.serve.runtime.http.load import run_load

ROOT = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = ROOT / ".venv-engines" / "bin" / "python"
PEERS = ("kvpool", "transformers", "vllm")


@dataclass
class Row:
    """One peer at one kind of prompt and concurrency (medians over rounds)."""

    runtime: str
    prompts: str  # "cold" or "prefix N"
    concurrency: int
    ttft_p50_ms: float | None = None
    tokens_per_s: float | None = None
    rounds: list[dict[str, float]] = field(default_factory=list)
    skipped: str | None = None  # why there are no figures


@dataclass(frozen=True)
class Measure:
    """One run of a batch of prompts: each request's TTFT, the tokens, the wall time."""

    ttfts: list[float]
    tokens: int
    wall_s: float
    errors: int = 0


class Peer:
    """A runtime under test: ``start`` (may raise ``Skip``), ``measure``, ``stop``."""

    name = ""

    def start(self, path: Path, warm: list[int], max_tokens: int) -> None:
        raise NotImplementedError

    def measure(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Measure:
        raise NotImplementedError

    def stop(self) -> None:
        pass


class Skip(Exception):
    """A peer that cannot run here (the reason is the message)."""


class HttpPeer(Peer):
    """A server with the OpenAI completions API, measured with the streaming load client."""

    url = ""
    extra_body: ClassVar[dict[str, Any]] = {}
    child: procs.Child | None = None  # the server process ``start`` launched

    def measure(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Measure:
        r = run_load(
            self.url,
            concurrency=concurrency,
            requests=len(prompts),
            max_tokens=max_tokens,
            prompts=prompts,
            extra_body=self.extra_body,
        )
        ttft = r.ttft_ms.get("p50", 0.0) / 1000
        return Measure([ttft] * (r.requests - r.errors), r.output_tokens, r.wall_s, r.errors)

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(30.0)


class KvpoolPeer(HttpPeer):
    name = "kvpool serve (1P+1D)"

    def start(self, path: Path, warm: list[int], max_tokens: int) -> None:
        args = ["serve", "--port", "0", "--model", str(path), "--prefill", "1", "--decode", "1"]
        args += ["--dram", "512MiB", "--kv-tokens", "32768"]
        self.child = procs.spawn("kvpool serve", procs.kvpool_args(*args), timeout=180)
        self.url = self.child.url
        self.measure([warm], 1, max_tokens)


class VllmPeer(HttpPeer):
    name = "vLLM OpenAI server"
    # token ids in each chunk, as kvpool sends them
    extra_body: ClassVar[dict[str, Any]] = {"return_token_ids": True}

    def __init__(self, python: Path, log_dir: Path) -> None:
        self.python = python
        self.log = log_dir / "vllm-server.log"

    def start(self, path: Path, warm: list[int], max_tokens: int) -> None:
        if not self.python.exists():
            raise Skip(f"{self.python} missing (bash .ci/engine-env builds the vLLM CPU venv)")
        probe = subprocess.run([str(self.python), "-c", "import vllm"], capture_output=True)
        if probe.returncode != 0:
            raise Skip(f"vllm does not import in {self.python}")
        port = _free_port()
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(path), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--dtype", "float32", "--max-model-len", "4096", "--enable-prefix-caching"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        with open(self.log, "w") as out:
            popen = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, text=True, process_group=0
            )
        self.child = procs.Child("vllm", popen)  # stop(): its whole process group
        self.url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(self.url, popen, self.log, 600.0)
        except Skip:
            self.child.stop(10.0)
            raise
        self.measure([warm], 1, max_tokens)


class TransformersPeer(Peer):
    name = "transformers generate"

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.model: Any = None

    def start(self, path: Path, warm: list[int], max_tokens: int) -> None:
        try:
            import torch
            import transformers
        except ImportError:
            raise Skip("transformers is absent (pip install -e '.[dev]')") from None
        torch.set_num_threads(self.threads)
        auto = transformers.AutoModelForCausalLM
        self.model = auto.from_pretrained(path, dtype=torch.float32).eval()
        self.measure([warm], 1, max_tokens)

    def measure(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Measure:
        import torch

        ttfts, tokens = [], 0
        start = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            x = torch.tensor(prompts[i : i + concurrency])
            first = _FirstToken()
            sent = time.perf_counter()
            with torch.no_grad():
                out = self.model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=None,
                    streamer=first,
                )
            ttfts += [first.at - sent] * len(x)
            tokens += (out.shape[1] - x.shape[1]) * len(x)
        return Measure(ttfts, tokens, time.perf_counter() - start)


class _FirstToken:
    """A ``generate`` streamer noting when the first new tokens come (its first ``put``
    is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, 0.0

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, popen: subprocess.Popen[str], log: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise Skip(f"the server exited ({popen.returncode}): {_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise Skip(f"the server was not ready in {timeout:.0f} s: {_tail(log)}")


def _tail(log: Path, n: int = 600) -> str:
    try:
        return log.read_text(errors="replace")[-n:].replace("\n", " | ")
    except OSError:
        return ""


@dataclass(frozen=True)
class Plan:
    requests: int = 8
    max_tokens: int = 32
    prefix: int = 1024
    unique: int = 64
    levels: tuple[int, ...] = (1, 4)
    rounds: int = 2
    seed: int = 0


def compare(
    path: Path,
    plan: Plan,
    peers: list[Peer],
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Every peer at every (prompts, concurrency), in interleaved rounds; rows in order."""
    rng = random.Random(plan.seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(2, 258) for _ in range(n)]

    shared = fresh(plan.prefix)
    warm = shared + fresh(plan.unique)
    live: list[Peer] = []
    rows: dict[tuple[str, str, int], Row] = {}
    kinds = ("cold", f"prefix {plan.prefix}")
    try:
        for peer in peers:
            try:
                peer.start(path, warm, plan.max_tokens)
                live.append(peer)
                log(f"{peer.name}: ready")
            except Skip as why:
                log(f"{peer.name}: skipped: {why}")
                for kind in kinds:
                    for c in plan.levels:
                        rows[(peer.name, kind, c)] = Row(peer.name, kind, c, skipped=str(why))
        for r in range(plan.rounds):
            for kind in kinds:
                for c in plan.levels:
                    if kind == "cold":
                        prompts = [fresh(plan.prefix + plan.unique) for _ in range(plan.requests)]
                    else:
                        prompts = [shared + fresh(plan.unique) for _ in range(plan.requests)]
                    for peer in live:
                        m = peer.measure(prompts, c, plan.max_tokens)
                        row = rows.setdefault((peer.name, kind, c), Row(peer.name, kind, c))
                        ttft = statistics.median(m.ttfts) * 1000 if m.ttfts else 0.0
                        tps = m.tokens / m.wall_s if m.wall_s else 0.0
                        row.rounds.append(
                            {"ttft_p50_ms": ttft, "tokens_per_s": tps, "errors": m.errors}
                        )
                        log(f"round {r} {kind} c={c} {peer.name}: {ttft:.1f} ms, {tps:.1f} tok/s")
    finally:
        for peer in live:
            peer.stop()
    for row in rows.values():
        if row.rounds:
            row.ttft_p50_ms = round(statistics.median(x["ttft_p50_ms"] for x in row.rounds), 1)
            row.tokens_per_s = round(statistics.median(x["tokens_per_s"] for x in row.rounds), 1)
    order = {p.name: i for i, p in enumerate(peers)}
    return sorted(
        rows.values(), key=lambda w: (kinds.index(w.prompts), w.concurrency, order[w.runtime])
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| runtime | prompts | concurrency | TTFT p50 ms | output tokens/s |",
        "|---|---|---|---|---|",
    ]
    for w in rows:
        if w.skipped:
            lines.append(
                f"| {w.runtime} | {w.prompts} | {w.concurrency} | skipped: {w.skipped} | |"
            )
        else:
            lines.append(
                f"| {w.runtime} | {w.prompts} | {w.concurrency} | {w.ttft_p50_ms} | "
                f"{w.tokens_per_s} |"
            )
    return "\n".join(lines)


def run_peers(args: Any) -> int:
    """``kvpool bench serve --checkpoint``: the table, and JSON with ``--json``."""
    from kvpool.bench.common import write_json

    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = set(names) - set(PEERS)
    if unknown or not names:
        raise SystemExit(f"kvpool bench serve: unknown peers {sorted(unknown)}; from {PEERS}")
    levels = tuple(int(x) for x in args.levels.split(","))
    plan = Plan(
        requests=args.requests or 8,
        max_tokens=args.max_tokens,
        prefix=args.shared_prefix if args.shared_prefix is not None else 1024,
        unique=args.unique_tokens,
        levels=levels,
        rounds=args.rounds,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-peers-") as tmp:
        path = Path(args.checkpoint)
        if args.checkpoint == "tiny":
            from kvpool.bench.tiny_checkpoint import write_tiny_checkpoint

            path = write_tiny_checkpoint(Path(tmp) / "tiny")
        threads = args.threads or 1  # as each kvpool worker (--threads 1)
        make: dict[str, Callable[[], Peer]] = {
            "kvpool": KvpoolPeer,
            "transformers": lambda: TransformersPeer(threads),
            "vllm": lambda: VllmPeer(Path(args.vllm_python), Path(tmp)),
        }
        rows = compare(path, plan, [make[n]() for n in names], log=_log)
    print(f"checkpoint {args.checkpoint}: {plan}")
    print(table(rows))
    write_json(args.json, {"plan": asdict(plan), "rows": [asdict(w) for w in rows]})
    failed = any(x["errors"] for w in rows for x in w.rounds)
    return 1 if failed else 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
