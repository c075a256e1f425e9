"""Pieces of reserved blocks over TCP (kvpool.cluster.client.fenced.write_parts):
a run of adjacent pieces of one block goes as one stamped write whose payload is
the pieces back to back, and a whole pipelined batch leaves in one gather send
(kvpool.transport.tcp_conn.DataConn.stamped_send). Against a real TCP data
server and the node's real fence (``fenced_server``, tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.bindings import buffers
from kvpool.cluster.client import fenced
from kvpool.transport import tcp as tcp_module
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import WriteStamp

EPOCH, BLOCK = 3, 8192  # (the term of the ``fenced_server`` fixture)
K1, K2 = b"\x01" * 16, b"\x02" * 16


def piece(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_adjacent_runs_in_exact_order() -> None:
    """Consecutive pieces of one stamp, each starting where the last ended, join one
    run; a gap, a step back, another stamp or an equal stamp further on start a new
    one; the runs keep the pieces' order."""
    a, b = WriteStamp(EPOCH, 1, 0, BLOCK, K1), WriteStamp(EPOCH, 2, BLOCK, BLOCK, K2)
    p = [piece(100, i) for i in range(8)]
    items = [
        (a, 0, p[0]),
        (a, 100, p[1]),  # adjacent: joins
        (a, 300, p[2]),  # a gap
        (a, 200, p[3]),  # a step back
        (b, 400, p[4]),  # adjacent bytes, another stamp
        (b, 500, p[5]),
        (a, 100, p[6]),
        (WriteStamp(EPOCH, 1, 0, BLOCK, K1), 200, p[7]),  # an equal stamp, not the same object
    ]
    runs = fenced.adjacent_runs(items)
    assert [(s, off, [id(x) for x in srcs]) for s, off, srcs in runs] == [
        (a, 0, [id(p[0]), id(p[1])]),
        (a, 300, [id(p[2])]),
        (a, 200, [id(p[3])]),
        (b, 400, [id(p[4]), id(p[5])]),
        (a, 100, [id(p[6]), id(p[7])]),
    ]
    assert fenced.adjacent_runs([]) == []


@pytest.mark.parametrize("iov_max", [w.IOV_MAX, 3], ids=["default", "cut-every-3-parts"])
def test_runs_land_whole_and_each_piece_gets_its_stamps_status(
    fenced_server, monkeypatch: pytest.MonkeyPatch, iov_max: int
) -> None:
    """A layer-like batch (two blocks, K then V halves, then a quarter that does not
    follow) with one block's stamp stale: the good block's bytes land where each
    piece was aimed, every piece of the stale run is refused and moves no byte, the
    statuses come one per piece in order, and the stream stays in sync (a second
    batch and a plain read after it are exact) whether the one gather send is cut
    at the default or every three parts."""
    monkeypatch.setattr(w, "IOV_MAX", iov_max)
    region, _, tcp = fenced_server
    good = WriteStamp(EPOCH, 10, 0, BLOCK, K1)
    stale = WriteStamp(EPOCH - 1, 11, BLOCK, BLOCK, K2)  # an older term
    q = BLOCK // 4
    want = np.zeros(BLOCK, np.uint8)
    for rounds in range(3):  # the stream's offset moves: every pad along the way
        parts = [piece(q, 10 * rounds + i) for i in range(6)]
        items = [
            (good, 0, parts[0]),
            (good, q, parts[1]),
            (stale, BLOCK, parts[2]),
            (stale, BLOCK + q, parts[3]),
            (good, 3 * q, parts[4]),
            (good, 2 * q, parts[5]),
        ]
        statuses = fenced.write_parts(tcp, tcp, items)
        assert statuses == [w.ST_OK, w.ST_OK, w.ST_STALE, w.ST_STALE, w.ST_OK, w.ST_OK]
        want[:q], want[q : 2 * q], want[3 * q :], want[2 * q : 3 * q] = parts[0:2] + parts[4:]
        assert np.array_equal(region[:BLOCK], want), rounds
        assert not region[BLOCK : 2 * BLOCK].any(), rounds
        out = np.zeros(BLOCK, np.uint8)
        tcp.read_into(0, out)
        assert np.array_equal(out, want), rounds


def test_a_batch_of_more_runs_than_one_send_takes_stays_exact(
    fenced_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More parts than ``IOV_MAX`` (each run two pieces plus its header): the gather
    send goes on in order over several calls and every byte lands."""
    monkeypatch.setattr(w, "IOV_MAX", 16)
    region, _, tcp = fenced_server
    n, size = 40, 512
    stamps = [WriteStamp(EPOCH, 20 + i, i * size, size, K1) for i in range(n)]
    halves = [piece(size // 2, i) for i in range(2 * n)]
    items = [(stamps[i // 2], i * size // 2, halves[i]) for i in range(2 * n)]
    assert len(fenced.adjacent_runs(items)) == n  # a block's two halves each
    assert fenced.write_parts(tcp, tcp, items) == [w.ST_OK] * (2 * n)
    assert np.array_equal(region[: n * size], np.concatenate(halves))
    assert tcp.bytes_written == n * size


def test_a_run_with_device_pieces_is_staged_once_in_order(
    fenced_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run holding a device piece goes through one host staging buffer of the run's
    size, its pieces copied in order (host ones too); a run of host pieces (torch CPU
    tensors and numpy arrays) is sent from the pieces themselves. No GPU here: torch
    CPU tensors stand in for device ones (the transport's region conversion, device
    test and staging are patched; the copy into staging is the real ``copy_region``)."""
    torch = pytest.importorskip("torch")
    staged: list[int] = []

    def staging(n: int) -> np.ndarray:
        staged.append(n)
        return np.empty(n, np.uint8)

    region, _, tcp = fenced_server
    stamp = WriteStamp(EPOCH, 30, 0, BLOCK, K1)
    parts = [piece(1024, 40 + i) for i in range(3)]
    host_run = [(stamp, 0, torch.from_numpy(parts[0].copy())), (stamp, 1024, parts[1])]
    assert fenced.write_parts(tcp, tcp, host_run) == [w.ST_OK] * 2
    assert np.array_equal(region[:2048], np.concatenate(parts[:2]))

    def as_region(obj: object, **kwargs: object) -> object:  # a "device" tensor stays one
        return obj if isinstance(obj, torch.Tensor) else buffers.as_region(obj, **kwargs)

    monkeypatch.setattr(tcp_module, "as_region", as_region)
    monkeypatch.setattr(tcp_module, "region_is_device", lambda r: isinstance(r, torch.Tensor))
    monkeypatch.setattr(tcp_module, "_staging", staging)
    run = [
        (stamp, 4096, torch.from_numpy(parts[2].copy())),
        (stamp, 5120, parts[0]),
        (stamp, 6144, torch.from_numpy(parts[1].copy())),
    ]
    assert fenced.write_parts(tcp, tcp, run) == [w.ST_OK] * 3
    assert staged == [3072]
    assert np.array_equal(region[4096:7168], np.concatenate([parts[2], parts[0], parts[1]]))
