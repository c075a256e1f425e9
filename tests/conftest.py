"""Shared fixtures: small embedded pools, deterministic keys and payloads.

Hypothesis profiles: ``ci`` (loaded when ``CI=true``) is derandomized, so the
same commit always runs the same examples and a green main stays green; a
failure prints its reproduction blob. ``dev`` (the default elsewhere) keeps
hypothesis' randomness, to keep finding new cases on developers' machines.
``HYPOTHESIS_PROFILE`` picks one explicitly.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from poolhelpers import BLOCK, make_keys

from kvpool import Pool
from kvpool.cluster.block_table import BlockTable
from kvpool.transport.base import RegionInfo
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,  # nothing replayed from earlier runs: the examples depend on the code only
    max_examples=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE")
    or ("ci" if os.environ.get("CI", "").lower() == "true" else "dev")
)


def pytest_configure(config: pytest.Config) -> None:
    """``.ci/run`` installs the ``[ucx]`` extra and sets ``KVPOOL_REQUIRE_UCX=1``: there
    the UCX tests must run, so an ucxx that does not import stops the run instead of
    letting every UCX test skip."""
    if os.environ.get("KVPOOL_REQUIRE_UCX") == "1":
        try:
            import ucxx  # noqa: F401
        except Exception as exc:
            why = f"KVPOOL_REQUIRE_UCX=1 but ucxx does not import: {exc!r}"
            raise pytest.UsageError(why) from exc


@pytest.fixture
def keys() -> list[bytes]:
    return make_keys(64)


@pytest.fixture
def pool() -> Iterator[Pool]:
    with Pool.embedded(dram_bytes=16 * BLOCK) as p:
        yield p


@pytest.fixture
def ssd_pool(tmp_path: object) -> Iterator[Pool]:
    with Pool.embedded(dram_bytes=4 * BLOCK, ssd_path=str(tmp_path), ssd_bytes=32 * BLOCK) as p:
        yield p


@pytest.fixture(autouse=True, scope="session")
def no_leaked_shared_memory() -> Iterator[None]:
    """Every arena this test process creates must be unlinked by the end."""
    yield
    mine = f"kvpool-{os.getpid()}-"
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith(mine)]
    assert not leaked, f"shared-memory arenas left behind: {leaked}"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected socket pair (closed after the test)."""
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.fixture(params=["native", "python"])
def checked_read_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test of pipelined checked reads (``DataConn.read_blocks``) once through
    the native exchange (``tcp_recv.read_blocks``; skipped where the extension was
    not built) and once through the Python one."""
    from kvpool.transport import tcp_recv

    if request.param == "python":
        monkeypatch.setattr(tcp_recv, "read_blocks", None)
    elif tcp_recv.read_blocks is None:
        pytest.skip(f"the native exchange is off: {tcp_recv.STATUS}")
    return str(request.param)


@pytest.fixture
def fenced_server() -> Iterator[tuple[np.ndarray, BlockTable, TcpTransport]]:
    """A real TCP data server on a 64 KiB region behind the node's real write fence
    (term 3, claims wait 0.2 s), and a client transport to it."""
    region = np.zeros(1 << 16, np.uint8)
    fence = BlockTable(lambda offset, size: offset + size + 1, claim_wait=0.2)
    fence.new_term(3)
    server = TcpDataServer(region, fence=fence)
    server.start()
    info = RegionInfo("n", region.nbytes, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance = server.instance
    transport = TcpTransport(info, timeout=5)
    yield region, fence, transport
    transport.close()
    server.close()
