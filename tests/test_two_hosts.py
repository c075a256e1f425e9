"""Two hosts on one machine: network namespaces joined by a veth pair.

The master and a node run in namespace A, the client in namespace B, so
they cannot share memory (different host identity) and every byte crosses
the veth over TCP. Skipped where namespaces cannot be created.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from clusterhelpers import spawn

ADDR_A, ADDR_B = "10.213.7.1", "10.213.7.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    suffix = str(os.getpid() % 100000)
    ns_a, ns_b = f"kvpA{suffix}", f"kvpB{suffix}"
    try:
        ip("netns", "add", ns_a)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        ip("netns", "add", ns_b)
        ip("link", "add", f"va{suffix}", "type", "veth", "peer", "name", f"vb{suffix}")
        ip("link", "set", f"va{suffix}", "netns", ns_a)
        ip("link", "set", f"vb{suffix}", "netns", ns_b)
        for ns, dev, addr in ((ns_a, f"va{suffix}", ADDR_A), (ns_b, f"vb{suffix}", ADDR_B)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


CLIENT = textwrap.dedent(
    """
    import sys, time, numpy as np
    sys.path.insert(0, {tests!r})
    from poolhelpers import BLOCK, make_keys, payload
    import kvpool
    keys = make_keys(24)
    with kvpool.connect({url!r}, token="two-hosts") as pool:
        deadline = time.monotonic() + 15
        while not pool.stats()["nodes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.put_batch(keys, [payload(i, 1 << 20) for i in range(24)]) == [True] * 24
        out = np.empty(1 << 20, np.uint8)
        ok = all(pool.get_into(k, out) == 1 << 20 and np.array_equal(out, payload(i, 1 << 20))
                 for i, k in enumerate(keys))
        print(ok, pool.prefix_match(keys), pool.stats()["transport"])
    """
)


def test_node_and_client_on_different_hosts_use_tcp(two_hosts: tuple[str, str]) -> None:
    ns_a, ns_b = two_hosts
    in_a = ["ip", "netns", "exec", ns_a]
    token = ["--token", "two-hosts"]
    master = spawn(["master", "--host", ADDR_A, "--port", "0", *token], prefix=in_a)
    node = spawn(
        [
            "node",
            "--master",
            master.address,
            "--host",
            ADDR_A,
            "--dram",
            "32MiB",
            "--heartbeat",
            "0.2",
            *token,
        ],
        prefix=in_a,
    )
    try:
        script = CLIENT.format(tests=os.path.dirname(__file__), url=f"kvpool://{master.address}")
        done = subprocess.run(
            ["ip", "netns", "exec", ns_b, sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True", "24", "tcp"]
    finally:
        node.stop()
        master.stop()
