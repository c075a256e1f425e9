"""Claims a failed or overtaken write must not leave held on the node.

A claim held past its write keeps every later allocation of the range waiting
``claim_wait`` and then refused BUSY. Under load (2 vCPUs, load average 8)
``kvpool bench remote`` stopped with "put found the key already stored" in
about half its runs: a CLAIM pipeline that timed out left the claims taken
ahead for the same batch held (their allocations revoked, the ranges handed
out again), and each BUSY made more claims time out. The node's log of the
refused claims showed placeholder-key claims (taken ahead) still held on
ranges the master had reallocated.

These drive the client's bracket (kvpool.cluster.client.fenced) against a
real TCP data server and the node's real BlockTable; only the failure itself
is injected (a control connection whose CLAIM or SEAL send raises).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from transport_fakes import OneSided

from kvpool.cluster.block_table import BlockTable
from kvpool.cluster.client import fenced
from kvpool.cluster.client.claims import TCP_AHEAD
from kvpool.transport import tcp_wire as w
from kvpool.transport.base import RegionInfo
from kvpool.transport.fencing import FENCE_OK, WriteStamp
from kvpool.transport.tcp import TcpTransport
from kvpool.transport.tcp_server import TcpDataServer

PAGE = 4096
NO_KEY = bytes(16)
CLAIM_WAIT = 0.3
EPOCH = 3


def ahead(alloc: int, offset: int) -> WriteStamp:
    return WriteStamp(EPOCH, alloc, offset, PAGE, NO_KEY)


def real(alloc: int, offset: int, key: bytes = b"\x01" * 16) -> WriteStamp:
    return WriteStamp(EPOCH, alloc, offset, PAGE, key)


class Failing:
    """A control connection whose CLAIMs (or SEALs) fail to send; the rest goes
    through the real one."""

    def __init__(self, real: TcpTransport, fail_op: int) -> None:
        self.real, self.fail_op = real, fail_op

    def stamped(self, items: Sequence[tuple[int, bytes, int, Any]]) -> list[int]:
        if items and items[0][0] == self.fail_op:
            raise TimeoutError("no answer from the node in time")
        return self.real.stamped(items)

    def stamped_later(self, items: Sequence[tuple[int, bytes, int, Any]]) -> Any:
        if items and items[0][0] == self.fail_op:
            raise TimeoutError("no answer from the node in time")
        return self.real.stamped_later(items)


@pytest.fixture
def node() -> Iterator[tuple[BlockTable, TcpTransport, TcpTransport, OneSided]]:
    """(the node's table, the claims-ahead connection, the put's control
    connection, the one-sided copy)."""
    region = np.zeros(16 * PAGE, np.uint8)
    fence = BlockTable(lambda offset, size: 1, claim_wait=CLAIM_WAIT)
    fence.new_term(EPOCH)
    server = TcpDataServer(region, fence=fence)
    server.start()
    info = RegionInfo("n", region.nbytes, tcp_host="127.0.0.1", tcp_port=server.address[1])
    info.tcp_instance = server.instance
    claims, control = TcpTransport(info, timeout=5), TcpTransport(info, timeout=5)
    yield fence, claims, control, OneSided(info, region)
    claims.close()
    control.close()
    server.close()


def claim_is_prompt(fence: BlockTable, stamp: WriteStamp) -> bool:
    """A newer allocation of the range is claimed at once (not after claim_wait)."""
    start = time.monotonic()
    status = fence.claim(stamp, owner=object())
    return status == FENCE_OK and time.monotonic() - start < CLAIM_WAIT / 2


def test_a_failed_claim_pipeline_releases_the_claims_taken_ahead(node) -> None:
    fence, claims, control, data = node
    assert fenced.ops(claims, w.OP_CLAIM, [ahead(6, 0)]) == [w.ST_OK]  # taken ahead
    items = [
        (real(6, 0), 0, np.full(PAGE, 1, np.uint8)),  # its claim was taken ahead
        (real(7, PAGE), PAGE, np.full(PAGE, 2, np.uint8)),  # claimed with the put
    ]
    with pytest.raises(TimeoutError):
        fenced.write_blocks_begin(data, Failing(control, w.OP_CLAIM), items, {0: 1})
    # the caller revokes both allocations; the master hands the ranges out again
    assert claim_is_prompt(fence, real(20, 0))
    assert claim_is_prompt(fence, real(21, PAGE))


def test_a_failed_seal_send_releases_the_claims_of_the_copied_blocks(node) -> None:
    fence, _, control, data = node
    items = [(real(8, 0), 0, np.full(PAGE, 3, np.uint8))]
    with pytest.raises(TimeoutError):
        fenced.write_blocks_begin(data, Failing(control, w.OP_SEAL), items)
    assert claim_is_prompt(fence, real(22, 0))


def test_a_claim_ahead_arriving_after_its_block_ended_is_released_not_kept(node) -> None:
    """A put took the grant while its claim was on the way, claimed, sealed and
    (with its commit and a remove) ended the block; the late claim taken ahead
    creates a fresh entry on the freed range. The claims thread now releases it
    (GrantStock.claimed returns it), so a new allocation there is not kept waiting."""
    fence, claims, _, _ = node
    assert fenced.ops(claims, w.OP_CLAIM, [ahead(9, 0)]) == [w.ST_OK]  # the late claim
    fenced.release_quietly(claims, [ahead(9, 0)])  # what GrantClaims does with it now
    assert claim_is_prompt(fence, real(23, 0))


def test_without_the_release_the_late_claim_would_keep_the_range_busy(node) -> None:
    """The failure the fixes remove, shown on the same table: a held claim taken
    ahead makes a newer allocation's claim wait claim_wait and fail BUSY."""
    fence, claims, _, _ = node
    assert fenced.ops(claims, w.OP_CLAIM, [ahead(10, 0)]) == [w.ST_OK]
    assert not claim_is_prompt(fence, real(24, 0))


# -- TCP claims taken ahead (kvpool.cluster.client.claims ``TCP_AHEAD``) ------------------


def tcp_ahead(alloc: int, offset: int) -> WriteStamp:
    return WriteStamp(EPOCH, alloc, offset, PAGE, TCP_AHEAD)


def test_a_tcp_write_finds_its_claim_taken_ahead_and_its_seal_ends_it(node) -> None:
    """The write claims the range it holds already (same allocation: no new entry),
    and sealing the block ends every hold on it, the claims connection's too."""
    fence, claims, control, _ = node
    assert fenced.ops(claims, w.OP_CLAIM, [tcp_ahead(11, 0)]) == [w.ST_OK]
    bytes_ = np.full(PAGE, 5, np.uint8)
    statuses, sealing = fenced.write_blocks_begin(
        control, control, [(real(11, 0), 0, bytes_)], {0: 1}
    )
    assert statuses == [w.ST_OK] and sealing is None
    assert [row[0] for row in fence.listing()] == [b"\x01" * 16]  # whole, under its key
    assert claim_is_prompt(fence, real(25, 0))  # whole, nothing in flight: replaced at once


def test_a_refused_tcp_write_releases_its_claim_taken_ahead(node) -> None:
    """A new term aborts the claim taken ahead, but its connection still holds it;
    the write is refused (STALE) and releases it, so the new term's allocation of
    the range is claimed at once. Without the release it waits and fails BUSY."""
    fence, claims, control, _ = node
    assert fenced.ops(claims, w.OP_CLAIM, [tcp_ahead(12, 0), tcp_ahead(13, PAGE)]) == [w.ST_OK] * 2
    fence.new_term(EPOCH + 1)
    items = [(real(12, 0), 0, np.full(PAGE, 6, np.uint8))]
    assert fenced.write_blocks_begin(control, control, items, {0: 1})[0] == [w.ST_STALE]
    newer = WriteStamp(EPOCH + 1, 30, 0, PAGE, b"\x02" * 16)
    assert claim_is_prompt(fence, newer)
    held = WriteStamp(EPOCH + 1, 31, PAGE, PAGE, b"\x02" * 16)  # no write released this one
    assert not claim_is_prompt(fence, held)


def test_a_failed_tcp_write_releases_its_claim_taken_ahead(node, monkeypatch) -> None:
    """The write's send fails (its connection dropped: the node ends that one's
    hold); the claim taken ahead on the claims connection is released too."""
    fence, claims, control, _ = node
    assert fenced.ops(claims, w.OP_CLAIM, [tcp_ahead(14, 0)]) == [w.ST_OK]
    real_stamped = control.stamped

    def stamped(items: Sequence[tuple[int, bytes, int, Any]]) -> list[int]:
        if items and items[0][0] != w.OP_RELEASE:
            raise ConnectionResetError("injected")
        return real_stamped(items)

    monkeypatch.setattr(control, "stamped", stamped)
    with pytest.raises(ConnectionResetError):
        fenced.write_blocks_begin(
            control, control, [(real(14, 0), 0, np.zeros(PAGE, np.uint8))], {0: 1}
        )
    assert claim_is_prompt(fence, real(32, 0))
