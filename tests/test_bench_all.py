"""``kvpool bench all``: one quick real run (tiny sizes) and the row schema it writes.

The run is real -- an embedded pool, an SSD tier in tmp, a master and a node
as processes, the raw-socket baseline server -- only smaller; this test checks
the shape and the arithmetic of what it reports, never the speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.transport import tcp_recv

KEYS = ["suite", "store", "op", "path", "size", "value", "unit", "baseline", "baseline_value",
        "ratio"]  # fmt: skip
OPS = {"put", "get_into", "put_batch", "get_into_batch", "prefix_match", "store", "load"}
FACTS = {"date_utc", "cpu_model", "cores", "cpuidle_driver", "kernel", "load_before",
         "load_after", "seconds", "steal_pct", "tcp_congestion", "memory", "native",
         "ssd_dir", "wake_us"}  # fmt: skip


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "all", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict, str]:
    tmp = tmp_path_factory.mktemp("bench-all")
    out = tmp / "rows.json"
    args = ["--quick", "--sizes", "64KiB", "--rounds", "1", "--json", str(out)]
    done = _bench(*args, "--ssd-dir", str(tmp), cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    facts = json.loads((tmp / "rows.machine.json").read_text())
    return rows, facts, done.stdout


def test_rows_have_exactly_the_schema(quick_run: tuple[list[dict], dict, str]) -> None:
    rows, _, _ = quick_run
    assert isinstance(rows, list) and rows
    for row in rows:
        assert list(row) == KEYS
        assert row["suite"] in {"local", "prefix", "remote", "layerwise"}
        assert row["store"] in {"kvpool", "mooncake"}
        assert row["op"] in OPS
        assert row["unit"] in {"GB/s", "us", "x"}
        assert row["size"] is None or (isinstance(row["size"], int) and row["size"] > 0)
        assert row["value"] > 0 and row["baseline_value"] > 0 and row["ratio"] > 0
        assert isinstance(row["baseline"], str) and row["baseline"]


def test_every_suite_reports_its_headline_rows(quick_run: tuple[list[dict], dict, str]) -> None:
    rows, _, _ = quick_run
    have = {(r["suite"], r["op"], r["path"]) for r in rows}
    for want in [
        ("local", "put", "dram"), ("local", "get_into", "ssd"), ("local", "get_into", "ssd-hit"),
        ("prefix", "prefix_match", "dram"),
        ("remote", "get_into", "tcp"), ("remote", "get_into_batch", "tcp"),
        ("remote", "put", "shm"), ("remote", "put_batch", "shm"),
        ("layerwise", "store", "dram"), ("layerwise", "load", "dram"),
    ]:  # fmt: skip
        assert want in have
    assert all(r["size"] == 65536 for r in rows if r["suite"] in ("local", "remote"))


def _mooncake_missing() -> str | None:
    """Why Mooncake Store cannot run here (None when it can)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for a missing libibverbs.so.1
        return f"Mooncake Store not importable ({type(exc).__name__}: {exc})"
    return None


def test_mooncake_rows_stand_beside_ours(quick_run: tuple[list[dict], dict, str]) -> None:
    """Issue 17: with ``[mooncake]`` installed, its TCP rows come from the same run as ours."""
    why = _mooncake_missing()
    if why is not None:
        if os.environ.get("KVPOOL_REQUIRE_MOONCAKE") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_MOONCAKE=1 but {why}")
        pytest.skip(why)
    rows, _, stdout = quick_run
    theirs = {(r["op"], r["path"]) for r in rows if r["store"] == "mooncake"}
    want = {("put", "tcp"), ("get_into", "tcp"), ("get_into_batch", "tcp")}
    assert theirs >= want, stdout[-2000:]
    assert "kvpool over Mooncake Store" in stdout
    ours = {(r["op"], r["path"], r["size"]) for r in rows if r["store"] == "kvpool"}
    for r in rows:
        if r["store"] == "mooncake":
            assert r["suite"] == "remote" and (r["op"], "tcp", r["size"]) in ours


def test_peer_margins_pair_each_tcp_row_with_ours() -> None:
    """kvpool over Mooncake per (op, size): GB/s over GB/s, and ratio over ratio."""
    from kvpool.bench.all import BenchRow, PeerMargin, peer_margins

    def row(store: str, op: str, path: str, size: int, value: float, base: float) -> BenchRow:
        return BenchRow("remote", store, op, path, size, value, "GB/s", "raw", base, value / base)

    rows = [
        row("kvpool", "get_into", "tcp", 1 << 20, 3.0, 3.2),
        row("kvpool", "get_into", "shm", 1 << 20, 16.0, 17.0),
        row("kvpool", "put", "tcp", 1 << 20, 2.0, 2.5),
        row("mooncake", "get_into", "tcp", 1 << 20, 1.5, 4.0),
        row("mooncake", "get_into_batch", "tcp", 1 << 20, 1.5, 4.0),  # none of ours: no margin
    ]
    assert peer_margins(rows) == [PeerMargin("get_into", 1 << 20, 2.0, 2.5)]
    assert peer_margins(rows[:3]) == []


def test_ratio_is_higher_is_better(quick_run: tuple[list[dict], dict, str]) -> None:
    rows, _, _ = quick_run
    for r in rows:
        if r["unit"] == "GB/s":
            expect = r["value"] / r["baseline_value"]
        elif r["unit"] == "us":
            expect = r["baseline_value"] / r["value"]
        else:  # layer-wise: the overlap ratio, and its inverse
            expect = 1 / r["value"]
        assert r["ratio"] == pytest.approx(expect, rel=0.02, abs=0.002)


def test_slow_rows_keep_the_precision_their_ratio_needs() -> None:
    """A row near 0.02 GB/s (a loaded CI machine) once printed a value and baseline
    whose quotient read 0.190 against its ratio 0.196: three decimals keep two
    digits of such a figure; four significant digits keep its precision."""
    from kvpool.bench.common import Timing, make_row

    ours, base = Timing(65536, [3.1e-3]), Timing(65536, [0.61e-3])
    row = make_row("put", "tcp", ours, base, "raw socket")
    assert row.gbps == pytest.approx(ours.gbps, rel=1e-3)
    assert row.ratio == pytest.approx(row.gbps / row.baseline_gbps, rel=0.002, abs=0.001)


def test_machine_facts_are_written_and_printed(quick_run: tuple[list[dict], dict, str]) -> None:
    _, facts, stdout = quick_run
    assert set(facts) >= FACTS
    assert len(facts["load_before"]) == 3 and len(facts["load_after"]) == 3
    assert facts["cpu_model"] in stdout and "load" in stdout
    mem, native = facts["memory"], facts["native"]  # kvpool.bench.machine
    assert f"memory {mem['gib']} GiB, NUMA nodes {mem['numa_nodes']}" in stdout
    assert (
        f"TCP receive spin: {native['tcp_recv']}; same-host checks: {native['shm_copy']}; "
        f"node's checked TCP reads: {native['tcp_serve']}; SSD writes: {native['ssd_aio']}"
        in stdout
    )
    ssd = facts["ssd_dir"]  # where the SSD rows' files lived
    assert f"SSD rows: {ssd['dir']} on {ssd['filesystem']} (" in stdout
    if ssd["o_direct"]:  # how each size's SSD reads went (from 1 MiB: pieces or one read)
        assert facts["ssd_reads"] == "64KiB: one read (below pieces)"
        assert f"SSD reads (local): {facts['ssd_reads']}" in stdout
    wake = facts["wake_us"]  # a hand-off between processes, before and after the suites
    assert set(wake) == {"before", "after"} and all(set(w) == {"0", "20"} for w in wake.values())
    assert all(us > 0 for w in wake.values() for us in w.values())
    assert "hand-off between processes (raw TCP ping-pong p50 after 0 / 20 ms idle): " in stdout
    cc = facts["tcp_congestion"]  # the host's and the one kvpool's data path runs
    assert f"host default {cc['host_default']}, data path and raw baselines" in stdout
    steal = facts["steal_pct"]  # every suite's share of CPU time stolen, and the whole run's
    assert set(steal) == {"local", "prefix", "remote", "layerwise", "all"}
    assert all(v is None or 0 <= v <= 100 for v in steal.values())
    if steal["all"] is not None:
        assert f"all {steal['all']}%" in stdout
    # each suite ran in a fresh process: the way each copy size class settled on in it
    assert set(facts["copy"]) == set(steal) - {"all"}
    assert all(facts["copy"][s] and f"copy ({s}): " in stdout for s in steal if s != "all")
    # how the client's TCP spins ended in each suite that spun (a pause sleeps them)
    spins = facts["tcp_spins"]
    assert ("remote" in spins) == tcp_recv.active() and set(spins) <= {"remote", "layerwise"}
    for suite, ends in spins.items():
        outcomes = ("ready", "timeouts", "crowded", "long_yields", "paused")
        assert ends["waits"] == sum(ends[k] for k in outcomes)
        assert f"TCP spins ({suite}, the client): {ends['waits']} waits: ready" in stdout


def test_cpu_steal_is_read_from_the_kernels_accounting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``/proc/stat``'s first line: steal is its eighth counter, the total the sum of
    the first eight (guest time is inside user time); a suite over the note's
    threshold is named under the facts."""
    from kvpool.bench.all import print_report
    from kvpool.bench.machine import STEAL_NOTE_PCT, CpuTimes

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 7 0\ncpu0 1 2 3\n")
    before = CpuTimes.now(str(stat))
    assert before == CpuTimes(steal=40, total=1000)
    stat.write_text("cpu  200 0 100 1400 10 0 0 290 9 0\n")
    after = CpuTimes.now(str(stat))
    assert after is not None and after.steal_pct_since(before) == 25.0  # 250 of 1000 ticks
    assert after.steal_pct_since(None) is None and before.steal_pct_since(after) is None
    stat.write_text("intr 1 2 3\n")  # not the accounting line
    assert CpuTimes.now(str(stat)) is None
    assert CpuTimes.now(str(tmp_path / "missing")) is None
    facts = dict.fromkeys(["date_utc", "cpu_model", "cores", "cpuidle_driver", "kernel"], "x")
    facts.update(python="3", load_before=[0, 0, 0], load_after=[0, 0, 0], seconds=1.0)
    facts["steal_pct"] = {"local": 0.5, "remote": 31.2, "layerwise": None, "all": 12.0}
    print_report([], facts)
    out = capsys.readouterr().out
    assert "CPU steal: local 0.5%, remote 31.2%, all 12.0%" in out
    assert f"over {STEAL_NOTE_PCT:g}% of CPU time during remote:" in out


def test_unknown_suite_is_refused(tmp_path: Path) -> None:
    done = _bench("--suites", "local,nope", cwd=tmp_path)
    assert done.returncode != 0
    assert "unknown suite(s) ['nope']" in done.stderr
