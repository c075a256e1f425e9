"""The CLAIM -> copy -> SEAL / RELEASE bracket of out-of-band writes
(kvpool.cluster.client.fenced), which the shared-memory and the UCX data
paths both use: the bytes move without the node's data server seeing them,
so the node is asked around the copy on its TCP data port.

ucxx is not installed here (no RDMA), so the UCX transport itself never runs
in this suite. These tests drive the bracket with a stand-in data transport
that is *not* a TcpTransport (the only thing fenced.py branches on) and copies
one-sidedly into the node's region, as a UCX put does, against a real TCP
data server and the node's real fence. They check the order (claim held
while the bytes land, sealed after), that a stale or busy claim moves no
byte, and that a failed copy releases its claim. What stays untested: UCX
itself (rkeys, endpoints, the listener), and that a UCX peer cannot write
without claiming (one-sided writes are not refused by the node: the fence
binds cooperating kvpool clients, as with shared memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvpool.cluster.block_table import CLAIMED, WRITTEN, BlockTable
from kvpool.cluster.client import fenced
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo, Transport
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.tcp import TcpTransport

K1, K2 = b"\x01" * 16, b"\x02" * 16
PAGE = 4096


class OneSided(Transport):
    """Writes straight into the node's region (a UCX put's effect), noting the
    fence state of each range at the moment its bytes land."""

    name = "one-sided"

    def __init__(self, info: RegionInfo, region: np.ndarray, fence: BlockTable) -> None:
        super().__init__(info)
        self.region, self.fence = region, fence
        self.seen: list[tuple[int, str | None]] = []
        self.fail = False

    def read_into(self, offset: int, out: Any) -> None:
        out[:] = self.region[offset : offset + out.nbytes]

    def write(self, offset: int, data: Any) -> None:
        if self.fail:
            raise ConnectionError("peer lost mid-copy")
        self.seen.append((offset, self.fence.state_of(offset)))
        self.region[offset : offset + data.nbytes] = data

    def write_many(self, items: Sequence[tuple[int, Any]]) -> None:
        for offset, data in items:
            self.write(offset, data)


@pytest.fixture
def node(fenced_server):
    region, fence, control = fenced_server  # 16 pages
    yield region, fence, control, OneSided(control.info, region, fence)


def block(fill: int, size: int = PAGE) -> np.ndarray:
    return np.full(size, fill, np.uint8)


def test_whole_blocks_are_claimed_while_copied_then_sealed(node) -> None:
    region, fence, control, data = node
    items = [(WriteStamp(3, 10 + i, i * PAGE, PAGE, K1), i * PAGE, block(i + 1)) for i in range(3)]
    claims, sealed = fenced.write_blocks_begin(data, control, items)
    assert claims == [w.ST_OK] * 3 and sealed is not None
    assert data.seen == [(i * PAGE, CLAIMED) for i in range(3)]  # claim held during the copy
    assert sealed() == [w.ST_OK] * 3
    assert [fence.state_of(i * PAGE) for i in range(3)] == [WRITTEN] * 3
    assert all((region[i * PAGE : (i + 1) * PAGE] == i + 1).all() for i in range(3))


def test_a_stale_claim_moves_no_byte_and_the_others_still_land(node) -> None:
    region, _, control, data = node
    newer = WriteStamp(3, 50, 0, PAGE, K2)
    assert fenced.ops(control, w.OP_CLAIM, [newer]) == [w.ST_OK]
    assert fenced.ops(control, w.OP_SEAL, [newer]) == [w.ST_OK]
    region[:PAGE] = 9  # the newer block's bytes
    items = [
        (WriteStamp(3, 40, 0, PAGE, K1), 0, block(1)),  # an expired allocation of that range
        (WriteStamp(2, 41, PAGE, PAGE, K1), PAGE, block(2)),  # an older master term
        (WriteStamp(3, 42, 2 * PAGE, PAGE, K1), 2 * PAGE, block(3)),
    ]
    claims, sealed = fenced.write_blocks_begin(data, control, items)
    assert claims == [w.ST_STALE, w.ST_STALE, w.ST_OK] and sealed is not None
    assert sealed() == [w.ST_STALE, w.ST_STALE, w.ST_OK]
    assert data.seen == [(2 * PAGE, CLAIMED)]
    assert (region[:PAGE] == 9).all() and not region[PAGE : 2 * PAGE].any()


def test_a_claim_taken_ahead_is_not_claimed_again(node) -> None:
    _, fence, control, data = node
    stamp = WriteStamp(3, 60, 0, PAGE, bytes(16))  # a grant: placeholder key
    assert fenced.ops(control, w.OP_CLAIM, [stamp]) == [w.ST_OK]
    sealed_with_key = WriteStamp(3, 60, 0, PAGE, K1)
    claims, sealed = fenced.write_blocks_begin(data, control, [(sealed_with_key, 0, block(4))], {0})
    assert claims == [w.ST_OK] and sealed is not None and sealed() == [w.ST_OK]
    assert fence.state_of(0) == WRITTEN
    held = fence.begin_read(K1, 0, 0, PAGE)  # the seal named the real key
    assert held is not None
    fence.end_read(held)


def test_a_failed_copy_releases_its_claims(node) -> None:
    _, _, control, data = node
    data.fail = True
    items = [(WriteStamp(3, 70, 0, PAGE, K1), 0, block(1))]
    with pytest.raises(ConnectionError):
        fenced.write_blocks_begin(data, control, items)
    # released: a newer allocation of the range is not kept waiting (no BUSY)
    assert fenced.ops(control, w.OP_CLAIM, [WriteStamp(3, 71, 0, PAGE, K2)]) == [w.ST_OK]


def test_a_piece_holds_its_claim_only_while_its_bytes_move(node) -> None:
    region, _, control, data = node
    stamp = WriteStamp(3, 80, 0, 2 * PAGE, K1)
    assert fenced.write_parts(data, control, [(stamp, 0, block(5))])[0] == w.ST_OK
    assert data.seen == [(0, CLAIMED)]
    # between pieces nothing is in flight: a newer allocation takes the range at once
    newer = WriteStamp(3, 81, 0, 2 * PAGE, K2)
    assert fenced.ops(control, w.OP_CLAIM, [newer]) == [w.ST_OK]
    # the resumed writer is refused and its next piece never lands
    assert fenced.write_parts(data, control, [(stamp, PAGE, block(6))])[0] == w.ST_STALE
    assert len(data.seen) == 1 and not region[PAGE : 2 * PAGE].any()


def test_pieces_of_several_blocks_claim_each_block_once_and_skip_a_refused_one(node) -> None:
    region, _, control, data = node
    first = WriteStamp(3, 100, 0, 2 * PAGE, K1)
    second = WriteStamp(3, 101, 2 * PAGE, 2 * PAGE, K2)
    taken = WriteStamp(3, 102, 4 * PAGE, PAGE, K1)
    assert fenced.ops(control, w.OP_CLAIM, [WriteStamp(3, 103, 4 * PAGE, PAGE, K2)]) == [w.ST_OK]
    items = [
        (first, 0, block(1)),
        (second, 2 * PAGE, block(2)),
        (taken, 4 * PAGE, block(3)),  # a newer allocation holds this range: refused
        (first, PAGE, block(4)),
        (second, 3 * PAGE, block(5)),
    ]
    assert fenced.write_parts(data, control, items) == [
        w.ST_OK, w.ST_OK, w.ST_STALE, w.ST_OK, w.ST_OK
    ]  # fmt: skip
    # the pieces of the claimed blocks landed in order, while their claims were held
    assert [offset for offset, _ in data.seen] == [0, 2 * PAGE, PAGE, 3 * PAGE]
    assert data.seen[:2] == [(0, CLAIMED), (2 * PAGE, CLAIMED)]  # (the fence keys blocks by start)
    assert [region[i * PAGE] for i in range(5)] == [1, 4, 2, 5, 0]
    # and released after: newer allocations take both ranges at once
    newer = [WriteStamp(3, 104, 0, 2 * PAGE, K2), WriteStamp(3, 105, 2 * PAGE, 2 * PAGE, K1)]
    assert fenced.ops(control, w.OP_CLAIM, newer) == [w.ST_OK, w.ST_OK]


def test_a_busy_range_moves_no_byte(node) -> None:
    _, _, control, data = node
    older = WriteStamp(3, 90, 0, PAGE, K1)
    other = TcpTransport(control.info, timeout=5)  # another writer, mid-copy
    try:
        assert fenced.ops(other, w.OP_CLAIM, [older]) == [w.ST_OK]
        newer = WriteStamp(3, 91, 0, PAGE, K2)
        assert fenced.write_parts(data, control, [(newer, 0, block(7))])[0] == w.ST_BUSY
        assert data.seen == []
    finally:
        other.close()
