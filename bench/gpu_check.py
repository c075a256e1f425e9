"""``kvpool bench gpu``: one prepared run proving kvpool's CUDA paths on a GPU machine.

Sections, run in this order, each independent (a failure is recorded with
its traceback and the next section still runs):

==========  ===================================================  =============
section     what                                                 module
==========  ===================================================  =============
tier        GPU tier put/get_into vs device copy_; demotion      gpu_tiers
            GPU -> DRAM -> SSD and promotion back, bytes exact
pinned      DRAM arena <-> CUDA, page-locked vs not, vs torch    gpu_tiers
            pinned copies (>= 0.9x); page-lock status in stats
transports  shm and TCP clients with torch CUDA / cupy buffers   gpu_transports
ucx         UCX between two processes, CUDA memory both ends,    gpu_transports
            GB/s vs TCP
layerwise   layer-wise store/load behind llama2-7b-shaped GPU    gpu_layerwise
            matmuls on CUDA side streams (overlap <= 1.1)
serve       tiny greedy CUDA == CPU; llama2-7b TTFT 4k/16k,      gpu_serve
            prefix reuse, TBT batch 1/16 (in process)
serve_cli   kvpool serve --device cuda --model llama2-7b         gpu_serve
            (master, node, workers) under a short HTTP load
checkpoint  a tiny HF checkpoint (fp32, bf16) on CUDA vs the CPU:   gpu_checkpoint
            logits, greedy tokens + logprobs, decode tokens/s
==========  ===================================================  =============

Isolation and budgets: each section runs in its own process
(``kvpool.bench.gpu_child``), so a crash, a sticky CUDA error or leaked GPU
memory ends with it. Each has a time budget (``--budget NAME=SECONDS``) and
the run an overall one (``--total-budget``, default sized for one ~8 minute
device call). Sections check their budget between measurements and cut
their rounds short; one still running past its budget (plus a grace) is
killed and recorded as ``timeout`` with what it had measured so far.

Output: ``gpu_check.json`` (rewritten after every section, so a run killed
half-way still leaves what it measured) and ``gpu_check.log`` under
``--out`` (default ``$OUT`` when set, else ``bench/out/gpu``). Exit status 0
when no check failed and no section errored or timed out.

``--dry-run``: no GPU needed. The same code paths with CPU tensors where
they exist, small sizes; every part that needs CUDA (or a package that is
absent) is listed under ``skipped`` with the reason. CI runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvpool.args import seconds_arg
from kvpool.bench.gpu_common import MiB, environment


@dataclass(frozen=True)
class Spec:
    """A section: its default budget on a GPU (seconds), the function that runs it
    (``module:function``, called as ``function(section, *inputs)``), and which of the
    run's settings are its inputs."""

    budget: float
    target: str
    inputs: tuple[str, ...] = ()


def _bench(module: str, function: str) -> str:
    return f"kvpool.bench.{module}:{function}"


SECTIONS: dict[str, Spec] = {
    "tier": Spec(30, _bench("gpu_tiers", "run_tier"), ("sizes",)),
    "pinned": Spec(30, _bench("gpu_tiers", "run_pinned"), ("sizes",)),
    "transports": Spec(30, _bench("gpu_transports", "run_transports"), ("sizes",)),
    "ucx": Spec(45, _bench("gpu_transports", "run_ucx"), ("sizes",)),
    "layerwise": Spec(45, _bench("gpu_layerwise", "run_layerwise"), ("layer_tokens",)),
    "serve": Spec(120, _bench("gpu_serve", "run_serve"), ("long_tokens",)),
    "serve_cli": Spec(90, _bench("gpu_serve", "run_serve_cli")),
    "checkpoint": Spec(60, _bench("gpu_checkpoint", "run_checkpoint")),
}
# Sections mostly end well inside their budgets. With the start-up (~1.5 min) one device
# call of timeout_s=450 leaves ~6 minutes of the 15 for a rerun of the failing sections.
TOTAL_BUDGET_S = 360.0
DRY_SIZES = [1 * MiB, 4 * MiB]
GPU_SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]


def register_gpu(suites: Any) -> None:
    p = suites.add_parser("gpu", help="prove the CUDA paths on a GPU machine (--dry-run: on CPU)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: CPU tensors, small sizes")
    p.add_argument("--only", default=None, help=f"comma list of sections ({', '.join(SECTIONS)})")
    p.add_argument("--out", default=None, help="report folder (default $OUT, else bench/out/gpu)")
    p.add_argument("--budget", action="append", default=[], metavar="SECTION=SECONDS")
    p.add_argument("--total-budget", type=seconds_arg, default=TOTAL_BUDGET_S, metavar="SECONDS")
    p.add_argument("--layer-tokens", type=int, default=4096, help="layerwise: prompt tokens")
    p.add_argument("--long-tokens", type=int, default=16384, help="serve: the long prompt")
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.bench.gpu_check")
    register_gpu(parser.add_subparsers(dest="suite", required=True))
    args = parser.parse_args(["gpu", *(argv if argv is not None else _argv())])
    return int(args.func(args))


def _argv() -> list[str]:
    return sys.argv[1:]


def run(args: argparse.Namespace) -> int:
    names = _names(args.only)
    budgets = {name: SECTIONS[name].budget for name in names}
    for item in args.budget:
        name, _, value = item.partition("=")
        if name not in SECTIONS or not value:
            raise SystemExit(f"--budget wants SECTION=SECONDS with SECTION in {sorted(SECTIONS)}")
        budgets[name] = float(value)
    device = "cpu" if args.dry_run else _cuda_or_exit()
    args.sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    out_dir = args.out or os.environ.get("OUT") or os.path.join("bench", "out", "gpu")
    os.makedirs(out_dir, exist_ok=True)
    report = _Report(out_dir, device, args.dry_run)
    run_deadline = time.monotonic() + args.total_budget
    for name in names:
        left = run_deadline - time.monotonic()
        if left < 5:
            report.sections[name] = {"status": "skipped", "reason": "overall budget spent"}
            report.log(f"== {name}: skipped, overall budget spent")
            continue
        budget = min(budgets[name], left)
        inputs = [getattr(args, attr) for attr in SECTIONS[name].inputs]
        report.run_section(name, budget, SECTIONS[name].target, inputs)
    return report.finish()


def _names(only: str | None) -> list[str]:
    if only is None:
        return list(SECTIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    return names


def _cuda_or_exit() -> str:
    try:
        import torch
    except ImportError:
        raise SystemExit(
            "torch is not installed; use --dry-run on a machine without CUDA"
        ) from None
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; use --dry-run to check the code paths on CPU")
    return "cuda"


class _Report:
    """The JSON report and its log, written as the run goes."""

    def __init__(self, out_dir: str, device: str, dry_run: bool) -> None:
        self.device = device
        self.json_path = os.path.join(out_dir, "gpu_check.json")
        self.tmp = tempfile.mkdtemp(prefix="kvpool-gpu-check-")
        self._log = open(os.path.join(out_dir, "gpu_check.log"), "w", buffering=1)  # noqa: SIM115
        self.started = time.time()
        self.head: dict[str, Any] = {"dry_run": dry_run, "device": device}
        self.sections: dict[str, dict[str, Any]] = {}
        self.head["machine"] = environment(device)
        self.log(f"kvpool bench gpu: device={device} dry_run={dry_run} {self.head['machine']}")

    def log(self, line: str) -> None:
        print(line, flush=True)
        self._log.write(line + "\n")

    def run_section(self, name: str, budget: float, target: str, inputs: list[Any]) -> None:
        self.log(f"== {name} (budget {budget:.0f} s)")
        start = time.monotonic()
        record = os.path.join(self.tmp, f"{name}.json")
        cmd = [sys.executable, "-m", "kvpool.bench.gpu_child", "--name", name]
        cmd += ["--target", target, "--inputs", json.dumps(inputs), "--device", self.device]
        cmd += ["--seconds", str(budget), "--record", record]
        cmd += ["--dry-run"] if self.head["dry_run"] else []
        child = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            process_group=0,
        )
        pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        pump.start()
        grace = min(10.0, 1.0 + budget / 3)  # sections stop themselves; this covers a last round
        killed = False
        try:
            child.wait(budget + grace)
        except subprocess.TimeoutExpired:
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # its children get SIGTERM (PDEATHSIG)
            child.wait()
        pump.join(5)
        entry = self._entry(record, child.returncode, killed, budget + grace)
        entry["seconds"] = round(time.monotonic() - start, 1)
        if entry["status"] == "ok" and any(not c["ok"] for c in entry["checks"]):
            entry["status"] = "failed"
        if entry["status"] in ("error", "timeout"):
            self.log(f"  {entry['status'].upper()}: {entry.get('error')}")
            if "traceback" in entry:
                self.log(entry["traceback"])
        self.log(f"== {name}: {entry['status']} in {entry['seconds']} s")
        self.sections[name] = entry
        self._write()

    def _pump(self, child: subprocess.Popen[str]) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            self.log(line.rstrip("\n"))

    def _entry(self, record: str, rc: int, killed: bool, limit: float) -> dict[str, Any]:
        """The section's record, with its status settled by how its process ended."""
        try:
            with open(record) as f:
                entry: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            entry = {"device": self.device, "figures": {}, "checks": [], "skipped": []}
        if killed:
            entry.update(status="timeout", error=f"killed, still running after {limit:.0f} s")
        elif rc != 0 or entry.get("status") in (None, "running"):
            how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
            entry.update(status="error", error=f"the section's process died ({how})")
        return entry

    def _write(self) -> None:
        payload = {
            **self.head,
            "seconds": round(time.time() - self.started, 1),
            "sections": self.sections,
        }
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        os.replace(tmp, self.json_path)

    def finish(self) -> int:
        self._write()
        bad = {
            n: e["status"]
            for n, e in self.sections.items()
            if e["status"] in ("failed", "error", "timeout")
        }
        skipped = sum(len(e.get("skipped", [])) for e in self.sections.values())
        problems = bad or "none"
        self.log(f"done: {len(self.sections)} sections, problems {problems}, {skipped} skipped")
        self.log(f"report: {self.json_path}")
        self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
