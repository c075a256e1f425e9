"""The machine facts ``kvpool bench`` reports beside its rows (kvpool.bench.machine).

Where the SSD rows ran (``storage_facts``): the mount, the block device under
it, O_DIRECT, and the note when the directory is memory -- a fresh machine whose
``/tmp`` is a tmpfs runs the SSD rows in memory, and only these facts say so.
Memory (``memory_facts``): size, NUMA nodes, transparent huge pages, free
page reporting, the DAMON threads running. The parsers run on crafted ``/proc``
and ``/sys`` files; the facts and the CLI also on this machine's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpool.bench.machine import (
    block_device,
    damon_schemes,
    free_page_reporting,
    machine_facts,
    memory_facts,
    mount_of,
    storage_facts,
    storage_lines,
)

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
30 27 259:1 / /data rw,relatime shared:5 - xfs /dev/nvme0n1p1 rw
31 30 0:40 / /data/x\\040y rw - tmpfs tmpfs rw
25 24 0:23 / /dev/shm rw - tmpfs tmpfs rw
26 24 0:27 / /dev/shm rw - ramfs none rw
this line is no mount
"""


def test_the_longest_mount_above_a_path_holds_it(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert mount_of("/data/sub/dir", str(info)) == ("/data", "xfs", "/dev/nvme0n1p1")
    assert mount_of("/data", str(info)) == ("/data", "xfs", "/dev/nvme0n1p1")
    assert mount_of("/database", str(info)) == ("/", "ext4", "/dev/vda")  # not under /data
    assert mount_of("/data/x y/z", str(info)) == ("/data/x y", "tmpfs", "tmpfs")  # \040
    assert mount_of("/dev/shm/k", str(info)) == ("/dev/shm", "ramfs", "none")  # stacked: last
    assert mount_of("/tmp", str(tmp_path / "missing")) == ("/", "unknown", "unknown")


def test_a_partition_reports_its_whole_disk(tmp_path: Path) -> None:
    """/sys/dev/block/MAJ:MIN links to the partition; queue/ and device/ are its disk's."""
    disk = tmp_path / "devices" / "pci0" / "block" / "sda"
    (disk / "sda1").mkdir(parents=True)
    (disk / "sda1" / "partition").write_text("1\n")
    (disk / "queue").mkdir()
    (disk / "queue" / "rotational").write_text("0\n")
    (disk / "device").mkdir()
    (disk / "device" / "model").write_text("Samsung SSD 980   \n")
    (tmp_path / "drivers" / "sd").mkdir(parents=True)
    (disk / "device" / "driver").symlink_to(tmp_path / "drivers" / "sd")
    root = tmp_path / "dev-block"
    root.mkdir()
    (root / "8:1").symlink_to(disk / "sda1")
    got = block_device(os.makedev(8, 1), str(root))
    assert got == {
        "name": "sda1",
        "disk": "sda",
        "driver": "sd",
        "model": "Samsung SSD 980",
        "rotational": False,
    }
    (root / "8:0").symlink_to(disk)  # the whole disk itself
    assert block_device(os.makedev(8, 0), str(root))["name"] == "sda"  # type: ignore[index]
    assert block_device(os.makedev(0, 40), str(root)) is None  # tmpfs, overlay: no device


def test_this_machines_temporary_directory(tmp_path: Path) -> None:
    facts = storage_facts(str(tmp_path))
    assert facts["dir"] == os.path.realpath(tmp_path)
    assert facts["memory_backed"] == (facts["filesystem"] in {"tmpfs", "ramfs"})
    assert isinstance(facts["o_direct"], bool)
    assert facts["device"] is None or facts["device"]["disk"]
    assert not list(tmp_path.iterdir())  # the O_DIRECT probe left nothing behind
    lines = storage_lines(facts)
    assert lines[0].startswith(f"SSD rows: {facts['dir']} on {facts['filesystem']} (")
    default = storage_facts(None)["dir"]  # the SSD rows' default
    assert default == os.path.realpath(tempfile.gettempdir())


def test_memory_and_refused_o_direct_are_named() -> None:
    base = {"dir": "/tmp", "mount": "/tmp", "source": "tmpfs", "device": None}
    memory = storage_lines({**base, "filesystem": "tmpfs", "memory_backed": True, "o_direct": True})
    assert memory[0] == "SSD rows: /tmp on tmpfs (tmpfs at /tmp; no block device); O_DIRECT taken"
    assert memory[1].startswith("note: /tmp is on tmpfs, memory and not a disk")
    assert "--ssd-dir" in memory[1]
    disk = {"name": "vda", "disk": "vda", "driver": "virtio_blk", "model": None, "rotational": None}
    buffered = storage_lines(
        {**base, "filesystem": "fuse", "memory_backed": False, "o_direct": False, "device": disk}
    )
    assert "disk vda (virtio_blk), rotation unknown); O_DIRECT refused" in buffered[0]
    assert buffered[1] == (
        "note: fuse refuses O_DIRECT at /tmp: no SSD rows; pass --ssd-dir a directory on a disk"
    )
    on_disk = storage_lines(
        {**base, "filesystem": "ext4", "memory_backed": False, "o_direct": True, "device": disk}
    )
    assert len(on_disk) == 1


@pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or storage_facts("/dev/shm")["filesystem"] != "tmpfs",
    reason="no tmpfs at /dev/shm on this machine",
)
def test_bench_local_says_when_its_ssd_rows_ran_in_memory(tmp_path: Path) -> None:
    args = ["bench", "local", "--tiers", "ssd", "--sizes", "64KiB", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", *args, "--ssd-dir", "/dev/shm"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "note: /dev/shm is on tmpfs, memory and not a disk" in done.stdout


def test_bench_all_leaves_out_the_ssd_rows_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory whose file system refuses O_DIRECT (some FUSE and network file
    systems) cannot hold the SSD rows (the tier's reads and its raw baseline both
    use it): ``bench all`` runs the DRAM rows alone and its report says why."""
    from kvpool.bench import all as bench_all

    refused = {**storage_facts(str(tmp_path)), "o_direct": False, "filesystem": "fuse"}
    monkeypatch.setattr(bench_all, "storage_facts", lambda directory: refused)
    plan = bench_all.Plan.quick()
    plan.local_sizes, plan.rounds = [65536], 1
    rows, facts = bench_all.run_all(plan, ["local"], str(tmp_path))
    assert {r.path for r in rows} == {"dram"}
    assert facts["ssd_dir"] is refused
    bench_all.print_report(rows, facts)
    assert (
        f"note: fuse refuses O_DIRECT at {refused['dir']}: no SSD rows" in capsys.readouterr().out
    )


def test_bench_local_refuses_ssd_rows_without_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool import cli
    from kvpool.bench import machine

    refused = {**storage_facts(str(tmp_path)), "o_direct": False, "filesystem": "fuse"}
    monkeypatch.setattr(machine, "storage_facts", lambda directory: refused)
    args = ["bench", "local", "--tiers", "ssd", "--sizes", "64KiB", "--ssd-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match=r"no O_DIRECT at .*: no SSD rows"):
        cli.main(args)
    assert "note: fuse refuses O_DIRECT" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing was measured


def test_memory_size_numa_nodes_and_huge_pages(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       24683792 kB\nMemFree:  1 kB\n")
    thp = tmp_path / "thp"
    thp.mkdir()
    (thp / "enabled").write_text("always [madvise] never\n")
    (thp / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    nodes = tmp_path / "node"
    for name in ("node0", "node1", "possible", "nodeX"):
        (nodes / name).mkdir(parents=True)
    virtio, reporting = tmp_path / "virtio", tmp_path / "page_reporting"
    reporting.mkdir()
    (reporting / "page_reporting_order").write_text("9\n")
    for name, device, features in (("virtio0", "0x0002", "1" * 64), ("virtio1", "0x0005", "0110")):
        (virtio / name).mkdir(parents=True)
        (virtio / name / "device").write_text(device + "\n")
        (virtio / name / "features").write_text(features + "\n")
    damon = tmp_path / "kdamonds"
    for kdamond, state, ops, actions in (
        ("0", "on", "paddr", ["pageout"]),
        ("1", "off", "vaddr", ["stat"]),  # not running: not a fact
        ("2", "on", "vaddr", []),
    ):
        ctx = damon / kdamond / "contexts" / "0"
        (ctx / "schemes").mkdir(parents=True)
        (damon / kdamond / "state").write_text(state + "\n")
        (ctx / "operations").write_text(ops + "\n")
        for i, action in enumerate(actions):
            (ctx / "schemes" / str(i)).mkdir()
            (ctx / "schemes" / str(i) / "action").write_text(action + "\n")
    (damon / "nr_kdamonds").write_text("3\n")
    paths = [str(tmp_path / "meminfo"), str(thp), str(nodes), str(virtio), str(reporting)]
    got = memory_facts(*paths, str(damon))
    assert got == {
        "gib": 23.5,
        "numa_nodes": 2,
        "thp_anon": "madvise",
        "thp_shmem": "never",
        "free_page_reporting": "off",  # a balloon, but without the reporting feature (bit 5)
        "damon": "paddr: pageout; vaddr: monitoring only",
    }
    for kdamond in ("0", "2"):
        (damon / kdamond / "state").write_text("off\n")
    assert damon_schemes(str(damon)) == "off"
    (virtio / "virtio1" / "features").write_text("0110010100000000\n")
    assert free_page_reporting(str(virtio), str(reporting)) == "on, 2 MiB blocks"
    (reporting / "page_reporting_order").write_text("0\n")  # single 4 KiB pages
    assert free_page_reporting(str(virtio), str(reporting)) == "on, 4 KiB blocks"
    (reporting / "page_reporting_order").unlink()
    assert free_page_reporting(str(virtio), str(reporting)) == "on"  # order unknown
    missing = tmp_path / "missing"
    assert memory_facts(*[str(missing)] * 6) == dict.fromkeys(got)


def test_the_native_helpers_say_which_path_runs() -> None:
    from kvpool.storage import direct_aio
    from kvpool.transport import shm_copy, tcp_read_gate, tcp_recv

    native = machine_facts()["native"]
    assert native == {
        "tcp_recv": tcp_recv.STATUS,
        "shm_copy": shm_copy.STATUS,
        "tcp_serve": tcp_read_gate.STATUS,
        "ssd_aio": direct_aio.STATUS,
    }
