"""The benchmark's second "host": a network namespace behind a veth pair (bench/veth.py).

The link is made for real (``ip``, ``tc``, sysfs) where this runs as root, its
settings read back from the kernel, and the data-path and pool benchmarks run
across it;
elsewhere those tests skip with the reason, and the checks that need no root run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.bench import veth
from kvpool.bench.remote import register_remote, run_remote
from kvpool.bench.remote_transport import run_remote_transport
from kvpool.bench.veth import Link, VethUnavailable, rate_bits, veth_peer


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout


@pytest.fixture
def as_root() -> Iterator[None]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to make a network namespace")
    yield
    assert f"kvpbench{os.getpid() % 100000}" not in _run("ip", "netns", "list")


def test_a_link_is_named_by_what_it_is_and_checked() -> None:
    assert Link().name == "veth1500"
    assert Link(9000, offloads=False, rate="25gbit").name == "veth9000-nogso@25gbit"
    assert rate_bits("10gbit") == 1e10 and rate_bits("1gbps") == 8e9
    assert rate_bits("500Mbit") == 5e8
    for bad in ({"mtu": 100}, {"mtu": 70000}, {"rate": "fast"}, {"rate": "10gigs"}):
        with pytest.raises(ValueError):
            Link(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 100mbit"):
        Link(rate="1000bit")  # minutes a round: refused up front


def test_without_root_nothing_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(veth.os, "geteuid", lambda: 1000)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("no command may run without root")

    monkeypatch.setattr(veth.subprocess, "run", refuse)
    with pytest.raises(VethUnavailable, match="root"), veth_peer(Link()):
        pass


def test_the_link_is_what_was_asked_and_goes_away(as_root: None) -> None:
    cpu = min(os.sched_getaffinity(0))
    tag = os.getpid() % 100000
    ours, theirs = f"kvbo{tag}", f"kvbt{tag}"
    link = Link(9000, offloads=False, rate="10gbit")
    with veth_peer(link, rx_cpus=({cpu}, {cpu})) as peer:
        for within, dev in (([], ours), (peer.prefix, theirs)):
            shown = _run(*within, "ip", "-d", "link", "show", dev)
            assert "mtu 9000" in shown and "gso_max_segs 1 " in shown
            assert "tbf" in _run(*within, "tc", "qdisc", "show", "dev", dev)
            mask = _run(*within, "cat", f"/sys/class/net/{dev}/queues/rx-0/rps_cpus")
            assert int(mask.replace(",", ""), 16) == 1 << cpu
        assert peer.remote in _run(*peer.prefix, "ip", "-4", "addr", "show", theirs)
        assert peer.local in _run("ip", "-4", "addr", "show", ours)
    assert ours not in _run("ip", "link", "show")


def test_a_block_that_raises_leaves_nothing_behind(as_root: None) -> None:
    with pytest.raises(RuntimeError, match="inside"), veth_peer(Link()):
        raise RuntimeError("inside")


def test_the_data_path_bench_crosses_the_link(as_root: None) -> None:
    """TCP only (the node is another host), every row labelled with the link;
    kvpool's bytes and the raw socket's both crossed it."""
    rows = run_remote_transport(
        [64 << 10], ("tcp", "shm"), rounds=1, link=Link(1500, offloads=False, rate="10gbit")
    )
    assert [(r.op, r.tier) for r in rows] == [
        (op, "veth1500-nogso@10gbit") for op in ("get_into", "put", "get_batch")
    ]
    assert all(r.gbps > 0 and r.baseline_gbps > 0 for r in rows)


def test_the_pool_bench_crosses_the_link(as_root: None, tmp_path: Path) -> None:
    """``kvpool bench remote --veth``: master, node and baseline server in the
    namespace (a token between them: off loopback they refuse to run without one),
    TCP rows only, each named after the link, the client's bytes over TCP."""
    parser = argparse.ArgumentParser()
    register_remote(parser.add_subparsers(dest="suite"))
    out = tmp_path / "rows.json"
    argv = ["remote", "--sizes", "64KiB", "--transport", "shm,tcp", "--rounds", "1"]
    argv += ["--ops", "put,get_into", "--working-set", "1MiB", "--json", str(out)]
    args = parser.parse_args([*argv, "--veth", "--veth-mtu", "9000"])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["op"], r["transport"]) for r in rows] == [
        ("put", "veth9000"),
        ("get_into", "veth9000"),
    ]
    assert all(r["gbps"] > 0 and r["baseline"].startswith("raw socket") for r in rows)


def test_the_pool_bench_refuses_a_peer_beyond_a_link() -> None:
    """Mooncake's peer runs on loopback: both together are refused before anything starts."""
    with pytest.raises(ValueError, match="loopback only"):
        run_remote([64 << 10], ["tcp"], peer="mooncake", link=Link())
