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

from kvpool.cluster.node_commits import IDLE_S

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


@pytest.fixture
def cluster_on_a(two_hosts: tuple[str, str]) -> Iterator[tuple[str, list[str], list[str]]]:
    """A master and a node in namespace A: (the pool's url, the prefix that runs
    a command in A, the one that runs it in B)."""
    ns_a, ns_b = two_hosts
    in_a = ["ip", "netns", "exec", ns_a]
    token = ["--token", "two-hosts"]
    master = spawn(["master", "--host", ADDR_A, "--port", "0", *token], prefix=in_a)
    node_args = ["--host", ADDR_A, "--dram", "32MiB", "--heartbeat", "0.2", *token]
    node = spawn(["node", "--master", master.address, *node_args], prefix=in_a)
    try:
        yield f"kvpool://{master.address}", in_a, ["ip", "netns", "exec", ns_b]
    finally:
        node.stop()
        master.stop()


def test_node_and_client_on_different_hosts_use_tcp(
    cluster_on_a: tuple[str, list[str], list[str]],
) -> None:
    url, _, in_b = cluster_on_a
    script = CLIENT.format(tests=os.path.dirname(__file__), url=url)
    done = subprocess.run(
        [*in_b, sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "24", "tcp"]


NODE_COMMIT_WRITER = textwrap.dedent(
    """
    import sys, time, numpy as np
    sys.path.insert(0, {tests!r})
    from poolhelpers import BLOCK, make_keys, payload
    from test_node_commits import stock_claimed_grants
    import kvpool
    keys = make_keys(9, seed=83)
    with kvpool.connect({url!r}, token="two-hosts", timeout=10) as pool:
        stock_claimed_grants(pool, keys[0], claimed=False)
        commits = pool._putter.commits
        sent, by_node = commits.sent, commits.by_node.count
        assert all(pool.put(keys[i], payload(i)) for i in range(1, 9))
        put_at = time.monotonic()
        frames, asked = commits.sent - sent, commits.by_node.count - by_node
        out = np.empty(BLOCK, np.uint8)
        own = pool.get_into(keys[8], out) == BLOCK and np.array_equal(out, payload(8))
        pool.flush()
        print(put_at, frames, asked, own, commits.idle(), pool.stats()["transport"])
    """
)

NODE_COMMIT_READER = textwrap.dedent(
    """
    import sys, time, numpy as np
    sys.path.insert(0, {tests!r})
    from poolhelpers import BLOCK, make_keys, payload
    import kvpool
    keys = make_keys(9, seed=83)
    with kvpool.connect({url!r}, token="two-hosts", timeout=10) as pool:
        deadline = time.monotonic() + 60
        while pool.exists([keys[8]]) != [True] and time.monotonic() < deadline:
            pass
        seen_at = time.monotonic()
        out = np.empty(BLOCK, np.uint8)
        ok = all(pool.get_into(k, out) == BLOCK and np.array_equal(out, payload(i))
                 for i, k in enumerate(keys))
        print(seen_at, ok, pool.stats()["transport"])
    """
)


def test_tcp_puts_the_node_commits_across_hosts_are_seen_by_both_hosts(
    cluster_on_a: tuple[str, list[str], list[str]],
) -> None:
    """Issue 17's node commits over a real network path: a writer in namespace B
    puts single blocks with ``WRITE_COMMIT`` (no COMMIT frame of its own), reads
    its own put back at once, and a reader on the node's host (namespace A, so
    same-host shared memory) sees the last put within the README's bound (0.5 s
    plus one poll period of the node's commit thread) with every byte exact."""
    url, in_a, in_b = cluster_on_a
    args = {"tests": os.path.dirname(__file__), "url": url}
    run = [sys.executable, "-c"]
    reader = subprocess.Popen(
        [*in_a, *run, NODE_COMMIT_READER.format(**args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        writer = subprocess.run(
            [*in_b, *run, NODE_COMMIT_WRITER.format(**args)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        seen, errors = reader.communicate(timeout=120)
    finally:
        reader.kill()
    assert writer.returncode == 0, writer.stderr[-2000:]
    assert reader.returncode == 0, errors[-2000:]
    put_at, frames, asked, own, idle, transport = writer.stdout.split()
    assert (frames, asked, own, idle, transport) == ("0", "8", "True", "True", "tcp")
    seen_at, ok, reader_transport = seen.split()
    assert (ok, reader_transport) == ("True", "shm")
    assert float(seen_at) - float(put_at) < 0.5 + IDLE_S


NO_TRANSPORT_WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from poolhelpers import BLOCK, make_keys, payload
    import kvpool
    from kvpool.errors import TransportUnavailableError
    keys = make_keys(6, seed=85)
    refused = 0
    with kvpool.connect({url!r}, token="two-hosts", timeout=10, transport="shm") as pool:
        for attempt in (lambda: pool.put(keys[0], payload(0)),
                        lambda: pool.put_batch(keys[1:3], [payload(1), payload(2)]),
                        lambda: pool.put(keys[3], payload(3))):
            try:
                attempt()
            except TransportUnavailableError as exc:
                refused += "shm: node is not on this host" in str(exc)
    with kvpool.connect({url!r}, token="two-hosts", timeout=10, transport="tcp") as pool:
        stored = pool.put_batch(keys[:4], [payload(i) for i in range(4)])
        out = np.empty(BLOCK, np.uint8)
        exact = all(pool.get_into(k, out) == BLOCK and np.array_equal(out, payload(i))
                    for i, k in enumerate(keys[:4]))
        print(refused, stored, exact)
    """
)


def test_a_put_no_transport_can_carry_raises_and_leaves_its_keys_free(
    cluster_on_a: tuple[str, list[str], list[str]],
) -> None:
    """A client on host B that allows only shared memory cannot write to A's node:
    each put raises ``TransportUnavailableError`` naming why, and gives back
    what it allocated, so the next writer's puts of the same keys store them
    (before, they answered False -- "stored already" -- until the master expired
    the allocations, and nothing was stored)."""
    url, _, in_b = cluster_on_a
    script = NO_TRANSPORT_WRITER.format(tests=os.path.dirname(__file__), url=url)
    done = subprocess.run(
        [*in_b, sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3", "[True,", "True,", "True,", "True]", "True"]
