"""``kvpool bench vllm``: time to first token of a real vLLM (CPU build) with and without kvpool.

Needs the engine venv (``bash .ci/engine-env``) and a source checkout (the
instances run ``tests/engines/vllm_driver.py``). On a tiny Llama made with
``transformers`` (``--layers``, hidden 128, 2 KV heads of 32, bf16) and
``--tokens``-token prompts, each instance alternates two kinds of request
(``--rounds`` of each, after a warm-up) and reports medians, so each ratio is
measured inside one process:

- ``vllm``: no connector, vLLM's prefix cache on: a fresh prompt (cold
  prefill) against the same prompt again (vLLM's local prefix-cache hit);
- ``kvpool-embedded``, ``kvpool-shm``, ``kvpool-tcp``: the kvpool connector
  (``kv_both``) with vLLM's prefix cache off, over an embedded pool or a
  cluster started here (one master, one node; client transport forced): a
  fresh prompt (cold prefill, and its blocks saved) against a stored prompt
  (its prefix loaded from the pool, the last block computed).

TTFT is the wall time of ``generate`` with ``max_tokens=1`` for one request.
From the connector's counters: bytes loaded per second of loader time, and
the layer-wise overlap ``1 - (time the forward pass waited) / (loader time)``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvpool.args import positive_int

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "engines" / "vllm_driver.py"
ENGINE_PYTHON = ROOT / ".venv-engines" / "bin" / "python"
MODES = ("vllm", "kvpool-embedded", "kvpool-shm", "kvpool-tcp")


def register_vllm(suites: Any) -> None:
    parser = suites.add_parser("vllm", help="vLLM TTFT: cold, vLLM prefix cache, kvpool")
    parser.add_argument("--tokens", type=positive_int, default=4096)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--python", default=str(ENGINE_PYTHON), help="the engine venv's python")
    parser.add_argument("--json", default=None, metavar="F")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvpool.bench.common import write_json

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise SystemExit(f"kvpool bench vllm: unknown modes {sorted(unknown)}; choose from {MODES}")
    if not Path(args.python).exists():
        raise SystemExit(f"kvpool bench vllm: {args.python} missing: run bash .ci/engine-env")
    rows = run_ttft(Path(args.python), modes, args.tokens, args.layers, args.rounds)
    for row in rows:
        print(json.dumps(row))
    write_json(args.json, {"rows": rows})
    return 0


def run_ttft(python: Path, modes: list[str], tokens: int, layers: int, rounds: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run(
            [str(python), str(DRIVER), "checkpoint", str(model), str(layers)],
            check=True,
            capture_output=True,
        )
        return [_mode(python, work, model, mode, tokens, rounds) for mode in modes]


def _mode(python: Path, work: Path, model: Path, mode: str, tokens: int, rounds: int) -> dict:
    rng = random.Random(0)
    hit = [rng.randrange(1, 1000) for _ in range(tokens)]
    fresh = [[rng.randrange(1, 1000) for _ in range(tokens)] for _ in range(rounds + 1)]
    # warm-up: a fresh prompt, then the hit prompt (stored or cached); then alternate
    schedule = [[fresh[0]], [hit], [hit]]
    for i in range(rounds):
        schedule += [[fresh[i + 1]], [hit]]
    job: dict[str, Any] = {
        "model": str(model),
        "rounds": schedule,
        "max_tokens": 1,
        "max_model_len": tokens + 64,
        "prefix_caching": mode == "vllm",
    }
    cluster = None
    try:
        if mode == "kvpool-embedded":
            job["kv"] = _kv({"embedded": {"dram_bytes": 1 << 30}})
        elif mode != "vllm":
            from kvpool.procs import spawn_kvpool

            master = spawn_kvpool(["master", "--port", "0"])
            node = spawn_kvpool(["node", "--master", master.address, "--dram", "1GiB"])
            cluster = (master, node)
            transport = mode.split("-", 1)[1]
            job["kv"] = _kv({"url": f"kvpool://{master.address}", "transport": transport})
        out = _instance(python, work, mode, job)
    finally:
        for child in reversed(cluster or ()):
            child.stop()
    return _summarise(mode, tokens, out)


def _kv(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.bindings.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _instance(python: Path, work: Path, name: str, job: dict[str, Any]) -> dict[str, Any]:
    job_path, out_path = work / f"{name}.json", work / f"{name}.out"
    job_path.write_text(json.dumps(job))
    proc = subprocess.run(
        [str(python), str(DRIVER), str(job_path), str(out_path)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"vLLM instance {name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(out_path.read_text())


def _summarise(mode: str, tokens: int, out: dict[str, Any]) -> dict[str, Any]:
    rounds = out["rounds"][3:]  # after the warm-up
    cold = [r["wall_s"] for r in rounds[0::2]]
    hit = [r["wall_s"] for r in rounds[1::2]]
    row: dict[str, Any] = {
        "mode": mode,
        "tokens": tokens,
        "ttft_cold_ms": 1e3 * statistics.median(cold),
        "ttft_hit_ms": 1e3 * statistics.median(hit),
        "hit_cached_tokens": rounds[1]["cached"][0],
    }
    row["speedup"] = row["ttft_cold_ms"] / row["ttft_hit_ms"]
    if "connector" in rounds[1]:
        loads = [_delta(out["rounds"], i) for i in range(4, len(out["rounds"]), 2)]
        loaded = sum(d["loaded_bytes"] for d in loads)
        load_s = sum(d["load_s"] for d in loads)
        wait_s = sum(d["load_wait_s"] for d in loads)
        row["loaded_bytes_per_hit"] = loaded // max(1, len(loads))
        row["load_GBps"] = loaded / load_s / 1e9 if load_s else None
        row["load_overlap"] = max(0.0, 1 - wait_s / load_s) if load_s else None
    return row


def _delta(rounds: list[dict[str, Any]], i: int) -> dict[str, float]:
    """Connector counters of round ``i`` alone."""
    before, after = rounds[i - 1]["connector"], rounds[i]["connector"]
    return {k: after[k] - before[k] for k in after}
