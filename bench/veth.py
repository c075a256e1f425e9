"""A second "host" for a benchmark: a network namespace joined to this one by a veth pair.

Loopback is not a network: its MTU is 64 KiB, and a send runs the receiver's
whole receive path on the sender's CPU. A veth pair into another namespace
gives the bytes a device hop, an MTU of one's choosing (1500 like most
Ethernet, 9000 jumbo), optionally no segmentation offloads and a rate limit,
and -- steered by RPS -- each end's receive path on its own side's CPUs, while
the two processes still share the machine: the closest to a second host one
machine offers (tests/test_two_hosts.py runs a cluster across such a pair).

``veth_peer`` makes the namespace and the pair and removes both when the block
ends, even when it raises. It needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and the
``ip`` command; without them it raises ``VethUnavailable`` with the reason, made
nothing and left nothing behind. ``Where.beyond`` is how servers run beyond it:
its address, the command prefix into the namespace, and the shared token that
servers off loopback refuse to run without (kvpool.rpc.auth).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvpool.rpc.auth import TOKEN_ENV

#: MTUs a veth pair takes here: IPv4's floor to a jumbo frame and then some.
MTU_MIN, MTU_MAX = 576, 65535
#: A rate as ``tc`` reads one: a positive number, then bits or bytes a second.
_RATE = re.compile(r"([1-9][0-9]*(?:\.[0-9]+)?)([kmgt]?)(bit|bps)", re.IGNORECASE)
#: The slowest link worth a run: at 100 Mbit/s a round of 16 MiB blocks takes minutes.
MIN_RATE_BITS = 100_000_000


class VethUnavailable(OSError):
    """No namespace and veth pair can be made here (no root, no ``ip``, no ``tbf``)."""


def rate_bits(rate: str) -> float:
    """Bits a second of a ``tc`` rate (``10gbit``: 1e10; ``1gbps``: 8e9); ValueError
    for anything else."""
    match = _RATE.fullmatch(rate)
    if match is None:
        raise ValueError(f"rate must read like 10gbit, 500mbit or 1gbps, got {rate!r}")
    number, prefix, unit = match.groups()
    scale = 1000 ** " kmgt".index(prefix.lower() or " ")
    return float(number) * scale * (8 if unit.lower() == "bps" else 1)


@dataclass(frozen=True)
class Link:
    """What the pair is like: its ``mtu``; ``offloads``: whether the stack may hand
    the device packets of many MTUs (GSO, as loopback does and as a NIC with
    segmentation and receive offloads lets it), or must cut every send into
    packets of one MTU, each crossing and received on its own, as without them;
    ``rate``: a token-bucket limit each way in ``tc``'s syntax (``10gbit``), None
    for none."""

    mtu: int = 1500
    offloads: bool = True
    rate: str | None = None

    def __post_init__(self) -> None:
        if not MTU_MIN <= self.mtu <= MTU_MAX:
            raise ValueError(f"mtu must be in [{MTU_MIN}, {MTU_MAX}], got {self.mtu}")
        if self.rate is not None and rate_bits(self.rate) < MIN_RATE_BITS:
            raise ValueError(f"rate must be at least 100mbit, got {self.rate!r}")

    @property
    def name(self) -> str:
        """A short label: ``veth1500``, ``veth9000-nogso``, ``veth1500@10gbit``."""
        rate = f"@{self.rate}" if self.rate else ""
        return f"veth{self.mtu}{'' if self.offloads else '-nogso'}{rate}"


@dataclass(frozen=True)
class VethPeer:
    """The far end of the pair: a process run under ``prefix`` lives in ``netns``
    and owns ``remote``; this namespace owns ``local``; the pair is ``link``."""

    netns: str
    local: str
    remote: str
    link: Link

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.netns]


def add_link_args(parser: argparse.ArgumentParser) -> None:
    """``--veth`` and the link's shape, for a benchmark's command line (``link_of``)."""
    parser.add_argument(
        "--veth",
        action="store_true",
        help="the servers in a network namespace of their own, over a veth pair (root; TCP only)",
    )
    parser.add_argument("--veth-mtu", type=int, default=1500, metavar="BYTES")
    parser.add_argument(
        "--veth-no-gso", action="store_true", help="every packet one MTU (no segmentation offload)"
    )
    parser.add_argument("--veth-rate", metavar="RATE", help="limit each way, in tc syntax: 10gbit")


def link_of(args: argparse.Namespace) -> Link | None:
    """The link ``add_link_args`` described (None without ``--veth``); ValueError
    for a bad MTU or rate."""
    if not args.veth:
        return None
    return Link(args.veth_mtu, not args.veth_no_gso, args.veth_rate)


def tcp_only(transports: Sequence[str]) -> list[str]:
    """The transports a benchmark beyond a link runs: TCP alone (the servers are on
    another host), saying which others it leaves out."""
    if left_out := [t for t in transports if t != "tcp"]:
        print(f"{','.join(left_out)}: skipped (the servers are on another host: TCP only)")
    return ["tcp"]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise VethUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _tc(within: list[str], dev: str, rate: str, mtu: int) -> None:
    """A token bucket of ``rate`` on ``dev``'s egress (``within``: the command
    prefix of its namespace); a burst of 64 packets or 256 KiB, whichever is
    more, and up to 1 ms queued before drops."""
    burst = str(max(64 * (mtu + 64), 256 << 10))
    args = ["qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst]
    done = subprocess.run(
        [*within, "tc", *args, "latency", "1ms"], capture_output=True, text=True, timeout=10
    )
    if done.returncode != 0:
        raise VethUnavailable(f"cannot limit {dev} to {rate}: {done.stderr.strip()}")


def _steer(dev: str, cpus: set[int], within: list[str]) -> None:
    """Process ``dev``'s received packets on ``cpus`` (its RPS mask)."""
    mask = f"{sum(1 << cpu for cpu in cpus):x}"
    path = f"/sys/class/net/{dev}/queues/rx-0/rps_cpus"
    done = subprocess.run(
        [*within, "sh", "-c", f"echo {mask} > {path}"], capture_output=True, text=True, timeout=10
    )
    if done.returncode != 0:
        why = done.stderr.strip()
        raise VethUnavailable(f"cannot steer {dev}'s receives to CPUs {sorted(cpus)}: {why}")


@contextmanager
def veth_peer(link: Link, rx_cpus: tuple[set[int], set[int]] | None = None) -> Iterator[VethPeer]:
    """A namespace linked to this one by a veth pair like ``link``, for the block.

    ``rx_cpus``: (this side's CPUs, the far side's): each end's received packets
    are processed on its own side's CPUs (RPS), as on two hosts, where a receiver's
    network stack runs on the receiving machine. Without it a veth pair runs both
    ends' receive paths on the sending CPU: per packet, with ``offloads`` off.

    Names and the /30 subnet derive from this process's pid, so concurrent runs
    do not collide; everything made is removed on the way out (deleting the
    namespace deletes its end of the pair, and with it ours)."""
    if shutil.which("ip") is None:
        raise VethUnavailable("no `ip` command (iproute2) on this machine")
    if os.geteuid() != 0:
        raise VethUnavailable("making a network namespace needs root")
    tag = os.getpid() % 100000
    netns, ours, theirs = f"kvpbench{tag}", f"kvbo{tag}", f"kvbt{tag}"
    net = 4 * (tag % 16384)  # a /30 of 10.215.0.0/16: .1 here, .2 there
    local = f"10.215.{net // 256}.{net % 256 + 1}"
    remote = f"10.215.{net // 256}.{net % 256 + 2}"
    _ip("netns", "add", netns)
    try:
        mtu = str(link.mtu)
        _ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
        try:
            _ip("link", "set", theirs, "netns", netns)
            peer = VethPeer(netns, local, remote, link)
            for side, within, dev, addr in (
                ([], [], ours, local),
                (["-n", netns], peer.prefix, theirs, remote),
            ):
                _ip(*side, "link", "set", dev, "mtu", mtu)
                if not link.offloads:  # at most one MTU per packet handed to the device
                    _ip(*side, "link", "set", dev, "gso_max_segs", "1")
                if link.rate:
                    _tc(within, dev, link.rate, link.mtu)
                _ip(*side, "addr", "add", f"{addr}/30", "dev", dev)
                _ip(*side, "link", "set", dev, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            if rx_cpus is not None:  # each end's receive path on its own side's CPUs
                _steer(ours, rx_cpus[0], [])
                _steer(theirs, rx_cpus[1], peer.prefix)
            yield peer
        finally:
            subprocess.run(["ip", "link", "del", ours], capture_output=True, timeout=10)
    finally:
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10)


@dataclass(frozen=True)
class Where:
    """Where the servers run: the address they listen on, the command prefix that
    runs them there, and the token they and their clients share (None: loopback
    needs none)."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()
    token: str | None = field(default=None, repr=False)

    @classmethod
    def beyond(cls, peer: VethPeer) -> Where:
        """In ``peer``'s namespace, on its address, with a fresh token."""
        return cls(peer.remote, tuple(peer.prefix), secrets.token_hex(16))

    @property
    def env(self) -> dict[str, str]:
        """Variables the servers run with."""
        return {TOKEN_ENV: self.token} if self.token else {}


LOOPBACK = Where()
