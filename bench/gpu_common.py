"""Plumbing shared by the sections of ``kvpool bench gpu`` (``kvpool.bench.gpu_check``).

``Section`` is what a section function gets: the device it runs on
(``cuda``, or ``cpu`` in a dry run), its deadline, and where to record
figures, checks (a named pass/fail with the evidence) and skipped parts
(a named part and the reason it could not run here). Nothing a section
records is ever dropped: a failed check stays in the report next to the
figures that were measured.

Timing: ``interleaved_medians`` runs each variant once per round, in turn,
so a noisy neighbour spreads over all of them, and reports medians; every
timed call ends with the device synchronised, so wall-clock time is the
time of the work. Buffers are allocated and touched before timing.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20


class SectionTimeout(RuntimeError):
    """A section ran past its time budget (raised by ``Section.check_time``)."""


@dataclass
class Section:
    """One section's context and its record (the JSON report's entry)."""

    name: str
    device: str  # "cuda" or "cpu" (dry run)
    dry_run: bool
    deadline: float  # time.monotonic() by which the section must end
    log: Callable[[str], None] = print
    scratch: str = "/tmp"
    record_path: str | None = None  # rewritten on every change: a killed section keeps its record
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    outcome: dict[str, Any] = field(default_factory=dict)  # status, error, traceback

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def check_time(self, what: str) -> None:
        if self.time_left() <= 0:
            raise SectionTimeout(f"{self.name}: time budget spent before {what}")

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        self.log(f"  [{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail != "" else ""))
        self.save()
        return bool(ok)

    def skip(self, part: str, reason: str) -> None:
        self.skipped.append({"part": part, "reason": reason})
        self.log(f"  [skip] {part}: {reason}")
        self.save()

    def figure(self, name: str, value: Any) -> None:
        self.figures[name] = value
        self.log(f"  {name} = {value}")
        self.save()

    def record(self) -> dict[str, Any]:
        return {
            **self.outcome,
            "device": self.device,
            "figures": self.figures,
            "checks": self.checks,
            "skipped": self.skipped,
        }

    def save(self) -> None:
        if self.record_path is None:
            return
        tmp = self.record_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.record(), f, default=str)
        os.replace(tmp, self.record_path)


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def pattern(nbytes: int, device: str, seed: int) -> Any:
    """``nbytes`` random uint8 on ``device`` (a torch tensor), reproducible from ``seed``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def same_bytes(a: Any, b: Any) -> bool:
    """Exact byte equality of two flat uint8 buffers (torch, numpy or cupy; any devices)."""
    import torch

    ta, tb = _as_torch(a), _as_torch(b)
    if ta.numel() != tb.numel():
        return False
    if ta.device != tb.device:
        tb = tb.to(ta.device)
    return bool(torch.equal(ta, tb))


def _as_torch(x: Any) -> Any:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        return x.reshape(-1).view(torch.uint8)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.reshape(-1).view(np.uint8))
    return torch.as_tensor(x, device="cuda").reshape(-1).view(torch.uint8)  # cupy


def interleaved_medians(
    ops: Mapping[str, Callable[[], object]],
    *,
    device: str,
    rounds: int,
    section: Section,
    resets: Mapping[str, Callable[[], object]] | None = None,
    reserve_s: float = 1.0,
) -> dict[str, float]:
    """Median seconds per call of each op, over interleaved rounds (one warm-up round).

    Stops early (after at least 3 timed rounds) when fewer than ``reserve_s``
    seconds of the section's budget are left; ``rounds_done`` tells how many ran.
    """
    resets = resets or {}
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds + 1):
        for name, op in ops.items():
            if name in resets:
                resets[name]()
            sync(device)
            start = time.perf_counter()
            op()
            sync(device)
            if r:  # round 0 warms up (allocators, kernels, page faults)
                times[name].append(time.perf_counter() - start)
        if r >= 3 and section.time_left() < reserve_s:
            break
    out = {name: statistics.median(t) for name, t in times.items() if t}
    out["rounds_done"] = min((len(t) for t in times.values()), default=0)
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("nan")


def environment(device: str) -> dict[str, Any]:
    """The machine's facts for the report: versions, GPU, CPU count, load."""
    import platform

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "shm_free_gib": round(shm_free_bytes() / (1 << 30), 1),
    }
    for mod in ("torch", "numpy", "cupy", "ucxx", "lmdb", "msgpack", "xxhash"):
        facts[f"{mod}_version"] = _version(mod)
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / (1 << 30), 1),
            cuda_runtime=torch.version.cuda,
            multiprocessors=props.multi_processor_count,
        )
    return facts


def _version(module: str) -> str | None:
    import importlib

    try:
        m = importlib.import_module(module)
        return str(getattr(m, "__version__", None) or getattr(m, "VERSION", "?"))
    except Exception as exc:  # absent, or broken (a CUDA build without its libraries)
        return f"absent ({type(exc).__name__})"


def shm_free_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize
