"""A same-host transport fills its mapping's page tables up front, unless told to stop.

A real /dev/shm file mapped by ``ShmTransport`` (and by nothing else in this
process); what is filled is that mapping's Rss in /proc/self/smaps.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Iterator

import pytest

from kvpool.transport.base import RegionInfo, host_identity
from kvpool.transport.shm import ShmTransport

MiB = 1 << 20
SIZE = 8 * MiB


@pytest.fixture
def region() -> Iterator[RegionInfo]:
    fd, path = tempfile.mkstemp(prefix="kvpool-test-populate-", dir="/dev/shm")
    try:
        os.ftruncate(fd, SIZE)
        yield RegionInfo("n", SIZE, shm_name=os.path.basename(path), host_id=host_identity())
    finally:
        os.close(fd)
        os.unlink(path)


def _resident(shm_name: str) -> int:
    """Bytes of this process's one mapping of ``shm_name`` its page tables map now."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    found = [i for i, line in enumerate(lines) if line.endswith("/" + shm_name)]
    assert len(found) == 1, found
    rss = next(x for x in lines[found[0] + 1 :] if x.startswith("Rss:"))
    return int(rss.split()[1]) * 1024


def _populate_works() -> bool:
    region = mmap.mmap(-1, 4096)
    try:
        region.madvise(23, 0, 4096)  # MADV_POPULATE_WRITE
    except OSError:
        return False
    finally:
        region.close()
    return True


pytestmark = pytest.mark.skipif(
    not _populate_works(), reason="this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)"
)


def test_the_mapping_is_filled_before_first_use(region: RegionInfo) -> None:
    transport = ShmTransport(region)
    try:
        assert _resident(region.shm_name) == SIZE
    finally:
        transport.close()


def test_a_cancelled_build_fills_nothing_more(region: RegionInfo) -> None:
    """``PeerTransports.close`` sets the event: a build under way stops populating
    (the transport it returns still works; it is closed at once anyway)."""
    cancel = threading.Event()
    cancel.set()
    transport = ShmTransport(region, cancel)
    try:
        assert _resident(region.shm_name) == 0
        transport.write(0, bytes(range(256)))  # works: the page faults in on first use
        out = bytearray(256)
        transport.read_into(0, out)
        assert out == bytes(range(256))
    finally:
        transport.close()
