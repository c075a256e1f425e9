"""The machine a benchmark ran on: its facts, and how much CPU it really had.

``machine_facts()``: CPU model, cores, cpuidle driver, kernel, Python, what
the figures depend on. ``CpuTimes`` reads the kernel's CPU accounting
(``/proc/stat``) so a run can say what share of CPU time the hypervisor took
from this VM (*steal*) while each suite ran.

Why steal (issue 17, session 15): on the shared 2 vCPU VMs a `kvpool bench`
row sometimes fell to 0.3-0.5x while every other run read ~1.0x. In those
runs both sides slowed (a 64 KiB TCP read's p50 went from ~100 us to ~1000
us for kvpool and ~900 us for the raw socket) and ``vmstat`` showed 32-38%
steal: the hypervisor ran something else on our vCPUs. Under steal the side
that needs more CPU per operation loses more, so such a row measures the
neighbour as much as the store. The load average does not show it (steal
is not load); the steal share does.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any

from kvpool.transport.tcp_congestion import CHOSEN

#: Steal above this share of CPU time marks a suite's rows as measured on a
#: contended machine (the report prints a note under the facts).
STEAL_NOTE_PCT = 5.0


def machine_facts() -> dict[str, Any]:
    """CPU model, cores, cpuidle driver, kernel, Python, TCP congestion control (the
    host's default and what kvpool's data path and the raw-socket baselines use:
    kvpool.transport.tcp_congestion): what the figures depend on."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/sys/devices/system/cpu/cpuidle/current_driver") as f:
            idle = f.read().strip()
    except OSError:
        idle = "none"
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpu_model": model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpuidle_driver": idle,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "tcp_congestion": CHOSEN.status(),
    }


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclass(frozen=True)
class CpuTimes:
    """All CPUs' time so far, in clock ticks: the part stolen by the hypervisor
    and the total (every state ``/proc/stat`` counts; guest time is already
    inside user time there, so it is left out of the total)."""

    steal: int
    total: int

    @classmethod
    def now(cls, stat: str = "/proc/stat") -> CpuTimes | None:
        """The counters now; None where the kernel does not report them."""
        try:
            with open(stat) as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != "cpu":
            return None
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
        return cls(steal=ticks[7], total=sum(ticks))

    def steal_pct_since(self, before: CpuTimes | None) -> float | None:
        """Share of CPU time stolen between ``before`` and this reading, in percent
        (None when unknown or no time passed)."""
        if before is None or self.total <= before.total:
            return None
        return round(100 * (self.steal - before.steal) / (self.total - before.total), 1)


def steal_since(before: CpuTimes | None) -> float | None:
    """Percent of CPU time stolen since ``before`` (``CpuTimes.now()`` taken earlier)."""
    now = CpuTimes.now()
    return None if now is None else now.steal_pct_since(before)
