"""The machine a benchmark ran on: its facts, and how much CPU it really had.

``machine_facts()``: CPU model, cores, cpuidle driver, kernel, Python, memory
and huge pages, which native helpers run: what the figures depend on.
``CpuTimes`` reads the kernel's CPU accounting (``/proc/stat``) so a run can
say what share of CPU time the hypervisor took from this VM (*steal*) while
each suite ran.

Why steal (issue 17, session 15): on the shared 2 vCPU VMs a `kvpool bench`
row sometimes fell to 0.3-0.5x while every other run read ~1.0x. In those
runs both sides slowed (a 64 KiB TCP read's p50 went from ~100 us to ~1000
us for kvpool and ~900 us for the raw socket) and ``vmstat`` showed 32-38%
steal: the hypervisor ran something else on our vCPUs. Under steal the side
that needs more CPU per operation loses more, so such a row measures the
neighbour as much as the store. The load average does not show it (steal
is not load); the steal share does.

``storage_facts(directory)``: where the SSD rows' files live (file system,
mount, block device, whether O_DIRECT is taken). Why: a fresh machine whose
``/tmp`` is a tmpfs (the default on several distributions) runs the SSD rows in
memory, and both sides of each row read 3-4 GB/s instead of a disk's 1-2; the
ratios still look plausible, so nothing but the facts says the row measured
no disk.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from kvpool.storage import direct_aio
from kvpool.transport import shm_copy, tcp_read_gate, tcp_recv
from kvpool.transport.tcp_congestion import CHOSEN

#: File systems whose files live in memory: SSD rows measured there measure DRAM.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})

#: Steal above this share of CPU time marks a suite's rows as measured on a
#: contended machine (the report prints a note under the facts).
STEAL_NOTE_PCT = 5.0


def machine_facts() -> dict[str, Any]:
    """CPU model, cores, cpuidle driver, kernel, Python, TCP congestion control (the
    host's default and what kvpool's data path and the raw-socket baselines use:
    kvpool.transport.tcp_congestion), memory (``memory_facts``) and which native
    helpers run (an install without a C compiler runs their Python fallbacks, and
    the TCP and same-host rows move with that): what the figures depend on."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    idle = _read("/sys/devices/system/cpu/cpuidle/current_driver") or "none"
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpu_model": model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpuidle_driver": idle,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "tcp_congestion": CHOSEN.status(),
        "memory": memory_facts(),
        "native": {
            "tcp_recv": tcp_recv.STATUS,
            "shm_copy": shm_copy.STATUS,
            "tcp_serve": tcp_read_gate.STATUS,
            "ssd_aio": direct_aio.STATUS,
        },
    }


def memory_facts(
    meminfo: str = "/proc/meminfo",
    thp: str = "/sys/kernel/mm/transparent_hugepage",
    nodes: str = "/sys/devices/system/node",
    virtio: str = "/sys/bus/virtio/devices",
    reporting: str = "/sys/module/page_reporting/parameters",
    damon: str = "/sys/kernel/mm/damon/admin/kdamonds",
) -> dict[str, Any]:
    """Memory in GiB, NUMA nodes, the transparent huge page settings for
    anonymous and for shared memory, ``free_page_reporting`` and ``damon_schemes``
    (None where unknown). The shared one matters here: a node's arena is shared
    memory, and with 4 KiB pages a same-host client fills ~260k page table entries
    per GiB it maps (issue 17, session 32)."""
    total = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = round(int(line.split()[1]) / (1 << 20), 1)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        numa = sum(1 for n in os.listdir(nodes) if n.startswith("node") and n[4:].isdigit())
    except OSError:
        numa = None
    return {
        "gib": total,
        "numa_nodes": numa or None,
        "thp_anon": _chosen(os.path.join(thp, "enabled")),
        "thp_shmem": _chosen(os.path.join(thp, "shmem_enabled")),
        "free_page_reporting": free_page_reporting(virtio, reporting),
        "damon": damon_schemes(damon),
    }


#: virtio device id of a memory balloon, and its feature bit for free page reporting.
_BALLOON_DEVICE, _BALLOON_F_REPORTING = "0x0005", 5


def free_page_reporting(virtio: str, reporting: str) -> str | None:
    """Whether this guest hands its free memory back to the host ("off", or "on,
    N MiB blocks": a virtio balloon that offers free page reporting; None where
    unknown). Why it is a fact (issue 17, session 35): memory the host took back
    costs a host fault on its next first touch -- on the Intel VM, touching 256 MiB
    freed 30 s earlier ran at 0.42 GB/s against 6.86 GB/s for memory freed just
    before, and a 6 GiB numpy array took 54 s -- so where buffers are allocated
    (and pre-faulted) decides what a row measures."""
    try:
        devices = os.listdir(virtio)
    except OSError:
        return None
    if not any(_offers_reporting(os.path.join(virtio, name)) for name in devices):
        return "off"
    order = _read(os.path.join(reporting, "page_reporting_order"))
    if order is None or not order.isdigit():
        return "on"
    kib = 4 << int(order)  # blocks of 2^order pages of 4 KiB
    return f"on, {kib >> 10} MiB blocks" if kib >= 1024 else f"on, {kib} KiB blocks"


def damon_schemes(kdamonds: str) -> str | None:
    """What the kernel's DAMON threads do to this machine's memory: "off" (none
    running), or each running context's address space and scheme actions ("paddr:
    pageout"); None where unknown. Why it is a fact (issue 17, session 50): the AMD
    EPYC VMs run a kdamond over all physical memory that pages out what stayed
    idle for a minute; it samples pages' accessed bits on either CPU, and took
    1.0-1.4% of the CPU samples of two 1 MiB TCP read loops, 0.3% of two others."""
    try:
        names = sorted(n for n in os.listdir(kdamonds) if n.isdigit())
    except OSError:
        return None
    running = []
    for name in names:
        kdamond = os.path.join(kdamonds, name)
        if _read(os.path.join(kdamond, "state")) != "on":
            continue
        contexts = os.path.join(kdamond, "contexts")
        for ctx in sorted(n for n in _listdir(contexts) if n.isdigit()):
            ops = _read(os.path.join(contexts, ctx, "operations")) or "?"
            schemes = os.path.join(contexts, ctx, "schemes")
            actions = [
                _read(os.path.join(schemes, s, "action")) or "?"
                for s in sorted(n for n in _listdir(schemes) if n.isdigit())
            ]
            running.append(f"{ops}: {', '.join(actions) or 'monitoring only'}")
    return "; ".join(running) or "off"


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _offers_reporting(device: str) -> bool:
    """Whether the virtio device at ``device`` is a balloon offering free page reporting
    (its ``features`` string: one character per feature bit)."""
    features = _read(os.path.join(device, "features")) or ""
    return (
        _read(os.path.join(device, "device")) == _BALLOON_DEVICE
        and features[_BALLOON_F_REPORTING : _BALLOON_F_REPORTING + 1] == "1"
    )


def _chosen(path: str) -> str | None:
    """The bracketed choice of a sysfs setting (``always [madvise] never``)."""
    text = _read(path) or ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


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


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steal_since(before: CpuTimes | None) -> float | None:
    """Percent of CPU time stolen since ``before`` (``CpuTimes.now()`` taken earlier)."""
    now = CpuTimes.now()
    return None if now is None else now.steal_pct_since(before)


def storage_facts(directory: str | None, mountinfo: str = "/proc/self/mountinfo") -> dict[str, Any]:
    """Where files made in ``directory`` (None: the temporary directory, as the
    SSD rows default) live: the mount's file system, mount point and source; the
    block device under it (None for a file system with none: tmpfs, overlay) with
    its driver, model and whether the kernel calls it rotational; whether an
    O_DIRECT write is taken there; and ``memory_backed`` (a tmpfs or ramfs)."""
    path = os.path.realpath(directory or tempfile.gettempdir())
    point, fstype, source = mount_of(path, mountinfo)
    return {
        "dir": path,
        "filesystem": fstype,
        "mount": point,
        "source": source,
        "memory_backed": fstype in MEMORY_FILESYSTEMS,
        "device": block_device(os.stat(path).st_dev),
        "o_direct": _takes_o_direct(path),
    }


def storage_lines(facts: dict[str, Any]) -> list[str]:
    """``storage_facts`` as the report prints it: where the SSD rows ran, and a note
    when that was memory, or when O_DIRECT was refused there (no SSD rows then:
    the tier and its raw baseline both read and write with O_DIRECT)."""
    device = facts["device"]
    if device is None:
        disk = "no block device"
    else:
        kind = {True: "rotational", False: "non-rotational", None: "rotation unknown"}
        what = ", ".join(x for x in (device["driver"], device["model"]) if x)
        disk = f"disk {device['disk']}" + (f" ({what})" if what else "")
        disk += f", {kind[device['rotational']]}"
    lines = [
        f"SSD rows: {facts['dir']} on {facts['filesystem']} ({facts['source']} at "
        f"{facts['mount']}; {disk}); O_DIRECT {'taken' if facts['o_direct'] else 'refused'}"
    ]
    if facts["memory_backed"]:
        lines.append(
            f"note: {facts['dir']} is on {facts['filesystem']}, memory and not a disk: the SSD "
            "rows measured DRAM; pass --ssd-dir a directory on the disk to measure"
        )
    elif not facts["o_direct"]:
        lines.append(
            f"note: {facts['filesystem']} refuses O_DIRECT at {facts['dir']}: no SSD rows; "
            "pass --ssd-dir a directory on a disk"
        )
    return lines


def mount_of(path: str, mountinfo: str) -> tuple[str, str, str]:
    """(mount point, file system type, source) of the mount holding ``path``: the
    longest mount point above it, the last one mounted where several stack."""
    best = ("/", "unknown", "unknown")
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 3 or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[dash + 1], fields[dash + 2])
    return best


def block_device(st_dev: int, sys_root: str = "/sys/dev/block") -> dict[str, Any] | None:
    """The block device ``st_dev`` names (its whole disk for a partition): name,
    driver, model, rotational; None where it is no block device."""
    node = os.path.join(sys_root, f"{os.major(st_dev)}:{os.minor(st_dev)}")
    if not os.path.exists(node):
        return None
    real = os.path.realpath(node)
    disk = os.path.dirname(real) if os.path.exists(os.path.join(real, "partition")) else real
    driver = os.path.join(disk, "device", "driver")
    rotational = _read(os.path.join(disk, "queue", "rotational"))
    return {
        "name": os.path.basename(real),
        "disk": os.path.basename(disk),
        "driver": os.path.basename(os.path.realpath(driver)) if os.path.exists(driver) else None,
        "model": _read(os.path.join(disk, "device", "model")),
        "rotational": None if rotational is None else rotational == "1",
    }


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _takes_o_direct(directory: str) -> bool:
    """Whether a 4 KiB O_DIRECT write to a new file in ``directory`` is taken."""
    fd, name = tempfile.mkstemp(prefix="kvpool-o-direct-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        os.unlink(name)
        return False
    try:
        with mmap.mmap(-1, 4096) as page:  # page-aligned, as O_DIRECT wants
            os.pwrite(fd, page, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(name)
