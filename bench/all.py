"""``kvpool bench all``: the headline ratio of every suite in one run (<= 5 minutes).

Runs, in this order, each suite's own measurement code (so the figures are
the ones ``kvpool bench SUITE`` reports) and turns its results into rows of
one schema:

- local: DRAM put/get_into vs ``np.copyto``, SSD tier store/read vs O_DIRECT;
- prefix: ``block_keys`` + ``prefix_match`` of a 128k-token prompt against a
  big catalog, vs the target latency (there is no other store to race here);
- remote: a real master + node (separate processes) over shm and tcp, single
  and batched put/get_into, vs numpy copy / the raw Python socket, plus the
  Mooncake Store rows when ``mooncake-transfer-engine-non-cuda`` is importable
  (same workload, same run);
- layerwise: layer-wise store/load overlapped with real compute, vs a bare
  copy thread overlapped with the same compute.

Every kvpool/baseline pair is measured in interleaved rounds (median of
``rounds``, >= 5 in a full run; layer-wise: best of rounds, as that suite
does). A row: ``suite, store, op, path, size, value, unit, baseline,
baseline_value, ratio``. ``ratio`` is higher-is-better: value / baseline for
throughput, baseline / value for latency; for layer-wise rows ``value`` is the
overlap ratio (1.0 = transfers fully hidden) and ``ratio`` its inverse.
The machine's facts (CPU model, cores, cpuidle driver, kernel, load average
before and after, the share of CPU time the hypervisor stole during each suite:
``kvpool.bench.machine``; the way each copy size class settled on,
kvpool.bindings.copy_choice) are printed with the table. Each suite runs in a
fresh process (as ``kvpool bench SUITE`` would): the copy ways a process learns
are its own, and one suite's must not measure the next. ``--json F`` writes the rows
(a list) to F and the facts to F's name with ``.machine.json`` in place of
its extension.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvpool.args import positive_int, sizes_arg
from kvpool.bench.common import write_json
from kvpool.bench.idle_rtt import raw_wake_us
from kvpool.bench.machine import (
    STEAL_NOTE_PCT,
    CpuTimes,
    load_average,
    machine_facts,
    steal_since,
    storage_facts,
    storage_lines,
)
from kvpool.bindings import stream_copy
from kvpool.config import format_size
from kvpool.transport import tcp_recv

if TYPE_CHECKING:
    from kvpool.bench.common import Row
    from kvpool.bench.remote_rows import RemoteRow

#: The prefix suite's latency target (issue 17): its rows' baseline.
PREFIX_TARGET_US = 200.0


@dataclass
class BenchRow:
    """One headline figure: ours (or a peer store's) against a baseline of the same run."""

    suite: str  # local, prefix, remote, layerwise
    store: str  # kvpool or mooncake
    op: str  # put, get_into, put_batch, get_into_batch, prefix_match, store, load
    path: str  # dram, ssd, shm, tcp, tcp-leased, ...
    size: int | None  # bytes per block; None where there is none
    value: float
    unit: str  # GB/s, us, x
    baseline: str
    baseline_value: float
    ratio: float  # higher is better (see the module docstring)


@dataclass
class Plan:
    """What a run measures: sizes, rounds and each suite's knobs."""

    local_sizes: list[int]
    remote_sizes: list[int]
    rounds: int
    batch: int
    working_set: int
    prefix_tokens: int
    prefix_catalog: int
    prefix_samples: int
    layers: int
    layer_tokens: int
    layer_rounds: int

    @classmethod
    def full(cls) -> Plan:
        mib = 1 << 20
        sizes = [64 << 10, mib, 4 * mib, 16 * mib]
        return cls(sizes, sizes, 5, 8, 64 * mib, 131_072, 1_000_000, 300, 32, 4096, 7)

    @classmethod
    def quick(cls) -> Plan:
        mib = 1 << 20
        sizes = [64 << 10, mib]
        return cls(sizes, sizes, 5, 4, 8 * mib, 131_072, 50_000, 100, 8, 1024, 3)


# --- suites -> rows ---------------------------------------------------------------------


def _throughput(suite: str, store: str, op: str, path: str, r: Row | RemoteRow) -> BenchRow:
    """A GB/s row from a suite's own result line (ours vs its same-run baseline)."""
    return BenchRow(suite, store, op, path, r.size, r.gbps, "GB/s", r.baseline, r.baseline_gbps,
                    r.ratio)  # fmt: skip


def local_rows(
    plan: Plan, ssd_dir: str | None, tiers: Sequence[str], read_ways: list[str] | None = None
) -> list[BenchRow]:
    from kvpool.bench.local import run_local

    results = run_local(plan.local_sizes, list(tiers), ssd_dir, plan.rounds, read_ways)
    return [_throughput("local", "kvpool", r.op, r.tier, r) for r in results]


def prefix_rows(plan: Plan) -> list[BenchRow]:
    from kvpool.bench.prefix import run_prefix

    got = run_prefix(plan.prefix_tokens, plan.prefix_catalog, plan.prefix_samples)
    p50 = float(got["p50_us"])
    what = f"target ({got['tokens']} tokens, {got['catalog_blocks']} blocks in the catalog)"
    return [
        BenchRow(
            "prefix",
            "kvpool",
            "prefix_match",
            "dram",
            None,
            p50,
            "us",
            what,
            PREFIX_TARGET_US,
            round(PREFIX_TARGET_US / p50, 3),
        )
    ]


def remote_rows(plan: Plan) -> list[BenchRow]:
    from kvpool.bench.remote import run_remote

    peer = "mooncake" if _mooncake_importable() else None
    if peer is None:
        print("remote: no Mooncake Store rows (pip install mooncake-transfer-engine-non-cuda)")
    rows = []
    for r in run_remote(plan.remote_sizes, ("shm", "tcp"), plan.batch, plan.rounds, True, peer,
                        plan.working_set):  # fmt: skip
        op, path = r.op, r.transport
        if op == "get_into_leased":  # the data path alone (one lease held over the reads)
            op, path = "get_into", f"{path}-leased"
        rows.append(_throughput("remote", r.store, op, path, r))
    return rows


def layerwise_rows(plan: Plan) -> list[BenchRow]:
    from kvpool.bench.layerwise import run_layerwise
    from kvpool.layout import KVLayout

    layout = KVLayout(plan.layers, 8, 128, "bfloat16", 512)
    got = run_layerwise(layout, plan.layer_tokens // 512, plan.layer_rounds)
    what = "copy thread overlapped with the same compute"
    rows = []
    for op, ours in (("store", got["overlap_ratio"]), ("load", got["load_overlap_ratio"])):
        rows.append(
            BenchRow(
                "layerwise",
                "kvpool",
                op,
                "dram",
                None,
                ours,
                "x",
                what,
                got["raw_overlap_ratio"],
                round(1.0 / ours, 3),
            )
        )
    return rows


@dataclass
class PeerMargin:
    """kvpool over a peer store for one (op, size) over TCP, from one run's rows.

    ``gbps_x`` divides the two stores' GB/s; ``baseline_x`` divides their ratios
    to the raw socket each was interleaved with. The peer's rows of a size are
    measured right after ours of that size: ``baseline_x`` corrects for the
    machine's speed drifting in between (the raw socket moved 3.0-4.9 GB/s at
    1 MiB within one run here) but carries both raw sockets' own noise. Both
    are printed; neither replaces the rows."""

    op: str
    size: int
    gbps_x: float
    baseline_x: float


def peer_margins(rows: Sequence[BenchRow], peer: str = "mooncake") -> list[PeerMargin]:
    """Every TCP (op, size) that both kvpool and ``peer`` measured in ``rows``."""
    ours = {(r.op, r.size): r for r in rows if r.store == "kvpool" and r.path == "tcp"}
    margins = []
    for r in rows:
        mine = ours.get((r.op, r.size)) if r.store == peer and r.path == "tcp" else None
        if mine is not None and r.size is not None:
            margins.append(PeerMargin(r.op, r.size, round(mine.value / r.value, 2),
                                      round(mine.ratio / r.ratio, 2)))  # fmt: skip
    return margins


def _mooncake_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("mooncake") is not None


SUITES = ("local", "prefix", "remote", "layerwise")


def suite_rows(
    suite: str, plan: Plan, ssd_dir: str | None, local_tiers: Sequence[str] = ("dram", "ssd")
) -> tuple[list[BenchRow], str, dict[str, int], str]:
    """One suite's rows, the way each copy size class settled on while it ran
    (``STATUS`` where none learns), how the process's TCP spins ended
    (``tcp_recv.counters``: a pause after a long yield makes TCP rows sleep), and
    how its SSD reads went ("" but for the local suite's SSD rows)."""
    read_ways: list[str] = []
    if suite == "local":
        rows = local_rows(plan, ssd_dir, local_tiers, read_ways)
    elif suite == "prefix":
        rows = prefix_rows(plan)
    elif suite == "remote":
        rows = remote_rows(plan)
    elif suite == "layerwise":
        rows = layerwise_rows(plan)
    else:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    copy_ways = stream_copy.learned() or stream_copy.STATUS
    return rows, copy_ways, tcp_recv.counters(), "; ".join(read_ways)


def run_all(
    plan: Plan, suites: Sequence[str] = SUITES, ssd_dir: str | None = None
) -> tuple[list[BenchRow], dict[str, Any]]:
    """Run the suites; (rows, machine facts with load before/after, the CPU steal
    during each suite and seconds taken)."""
    facts = machine_facts()
    facts["load_before"] = load_average()
    facts["wake_us"] = {"before": raw_wake_us()}
    facts["steal_pct"] = {}
    start, started = time.monotonic(), CpuTimes.now()
    rows: list[BenchRow] = []
    facts["copy"], facts["tcp_spins"] = {}, {}
    tiers: tuple[str, ...] = ("dram", "ssd")
    if "local" in suites:  # no SSD rows where O_DIRECT is refused (the report says so)
        facts["ssd_dir"] = storage_facts(ssd_dir)
        tiers = tiers if facts["ssd_dir"]["o_direct"] else ("dram",)
    # Each suite in a fresh process, as ``kvpool bench SUITE`` runs it: what one suite
    # leaves in a process (copy ways learned on its memory, threads, a big catalog)
    # must not measure the next (issue 17, session 20: the 4 MiB class settled on
    # streaming by the embedded pool's copies made the same-host 4 MiB reads 0.79).
    spawn = multiprocessing.get_context("spawn")
    for suite in suites:
        before = CpuTimes.now()
        with ProcessPoolExecutor(1, mp_context=spawn) as fresh:
            got, facts["copy"][suite], spins, read_ways = fresh.submit(
                suite_rows, suite, plan, ssd_dir, tiers
            ).result()
        rows += got
        if read_ways:
            facts["ssd_reads"] = read_ways
        if spins.get("waits"):
            facts["tcp_spins"][suite] = spins
        facts["steal_pct"][suite] = steal_since(before)
    facts["steal_pct"]["all"] = steal_since(started)
    facts["load_after"] = load_average()
    facts["wake_us"]["after"] = raw_wake_us()
    facts["seconds"] = round(time.monotonic() - start, 1)
    return rows, facts


# --- CLI -----------------------------------------------------------------------------------


def register_all(suites: Any) -> None:
    parser = suites.add_parser("all", help="the headline ratio of every suite, one run")
    parser.add_argument(
        "--json",
        default=None,
        metavar="F",
        help="write the rows to F (facts: same name, .machine.json)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes, smaller workloads")
    parser.add_argument("--suites", default=",".join(SUITES), help="comma list (default: all)")
    parser.add_argument("--sizes", type=sizes_arg, default=None, help="override block sizes")
    parser.add_argument("--rounds", type=positive_int, default=None, help="override rounds")
    parser.add_argument("--ssd-dir", default=None, help="directory for the SSD rows (/tmp)")
    parser.add_argument(
        "--markdown", action="store_true", help="print the table as markdown (for RESULTS.md)"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    plan = Plan.quick() if args.quick else Plan.full()
    if args.sizes:
        plan.local_sizes = plan.remote_sizes = list(args.sizes)
    if args.rounds:
        plan.rounds = args.rounds
        plan.layer_rounds = min(plan.layer_rounds, args.rounds)
        plan.prefix_samples = max(10, min(plan.prefix_samples, 20 * args.rounds))
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise SystemExit(f"unknown suite(s) {sorted(unknown)}; choose from {', '.join(SUITES)}")
    rows, facts = run_all(plan, suites, args.ssd_dir)
    print_report(rows, facts, markdown=args.markdown)
    if args.json:
        write_json(args.json, [asdict(r) for r in rows])
        write_json(os.path.splitext(args.json)[0] + ".machine.json", facts)
    return 0


def print_report(rows: Sequence[BenchRow], facts: dict[str, Any], markdown: bool = False) -> None:
    print(
        f"{facts['date_utc']} UTC  {facts['cpu_model']}, {facts['cores']} cores, cpuidle "
        f"{facts['cpuidle_driver']}, kernel {facts['kernel']}, Python {facts['python']}; "
        f"load {facts['load_before']} -> {facts['load_after']}; {facts['seconds']} s"
    )
    if "tcp_congestion" in facts:  # (facts written before session 27 lack it)
        cc = facts["tcp_congestion"]
        print(f"TCP congestion control: host default {cc['host_default']}, data path and "
              f"raw baselines {cc['data_path']}")  # fmt: skip
    if "memory" in facts:  # (facts written before session 33 lack these)
        mem = facts["memory"]
        print(f"memory {mem['gib']} GiB, NUMA nodes {mem['numa_nodes']}, transparent huge "
              f"pages: anonymous {mem['thp_anon']}, shared {mem['thp_shmem']}; free page "
              f"reporting to the host: {mem.get('free_page_reporting')}; DAMON: "
              f"{mem.get('damon', '-')}")  # fmt: skip
        native = facts["native"]
        print(
            f"TCP receive spin: {native['tcp_recv']}; same-host checks: {native['shm_copy']}; "
            f"node's checked TCP reads: {native.get('tcp_serve', '-')}; "
            f"SSD writes: {native['ssd_aio']}"
        )
    if "wake_us" in facts:  # (facts written before session 36 lack it)
        wake = [f"{when} {w['0']:.0f} / {w['20']:.0f} us" for when, w in facts["wake_us"].items()]
        print("hand-off between processes (raw TCP ping-pong p50 after 0 / 20 ms idle): "
              + ", ".join(wake))  # fmt: skip
    if "ssd_dir" in facts:
        print("\n".join(storage_lines(facts["ssd_dir"])))
    if "ssd_reads" in facts:  # (facts written before session 42 lack it)
        print(f"SSD reads (local): {facts['ssd_reads']}")
    for suite, ways in facts.get("copy", {}).items():  # each suite ran in its own process
        print(f"copy ({suite}): {ways}")
    for suite, spins in facts.get("tcp_spins", {}).items():
        state = ("waits", "max_spinners", "next_pause_us")  # the rest: how the waits ended
        ends = ", ".join(f"{k} {v}" for k, v in spins.items() if k not in state)
        print(f"TCP spins ({suite}, the client): {spins['waits']} waits: {ends}")
    steal = {k: v for k, v in facts.get("steal_pct", {}).items() if v is not None}
    if steal:
        print("CPU steal: " + ", ".join(f"{k} {v}%" for k, v in steal.items()))
        stolen = [k for k, v in steal.items() if v > STEAL_NOTE_PCT and k != "all"]
        if stolen:
            print(
                f"note: the hypervisor took over {STEAL_NOTE_PCT:g}% of CPU time during "
                f"{', '.join(stolen)}: those rows were measured on a contended machine"
            )
    if markdown:
        print("\n| suite | store | op | path | size | value | unit | baseline | baseline value "
              "| ratio |\n|---|---|---|---|---:|---:|---|---|---:|---:|")  # fmt: skip
    else:
        print(f"{'suite':<9} {'store':<8} {'op':<14} {'path':<10} {'size':>7} {'value':>9} "
              f"{'unit':<4} {'base':>9} {'ratio':>6}  baseline")  # fmt: skip
    for r in rows:
        size = format_size(r.size) if r.size else "-"
        if markdown:
            cells = [r.suite, r.store, r.op, r.path, size, f"{r.value:.3g}", r.unit, r.baseline,
                     f"{r.baseline_value:.3g}", f"{r.ratio:.2f}"]  # fmt: skip
            print("| " + " | ".join(cells) + " |")
        else:
            print(
                f"{r.suite:<9} {r.store:<8} {r.op:<14} {r.path:<10} {size:>7} {r.value:>9.3g} "
                f"{r.unit:<4} {r.baseline_value:>9.3g} {r.ratio:>6.2f}  {r.baseline}"
            )
    margins = peer_margins(rows)
    if margins:
        print("kvpool over Mooncake Store, TCP, this run (GB/s quotient; quotient of the "
              "ratios to each one's raw socket):")  # fmt: skip
        for m in margins:
            print(f"  {m.op:<14} {format_size(m.size):>7}  {m.gbps_x:.2f}x  {m.baseline_x:.2f}x")
