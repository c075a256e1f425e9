"""Whether the SSD tier reads each block size in pieces or in one read
(kvpool.storage.piece_choice, issue 17).

The learner with an injected clock and coin: trials go in pairs, one read each
way, a class settles after ``trials`` timed reads each way on pieces unless one
read beat them by more than ``MARGIN``, settles once, and counts no read that
failed or raised. Then the SSD tier itself: whatever the way, learning or
settled or fixed by ``$KVPOOL_SSD_READS``, every read and every SSD hit's copy
on to the caller's buffer is exact, and a corrupt block is a miss.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from poolhelpers import aligned, ssd_tier_holding

from kvpool.eviction import make_policy
from kvpool.storage.piece_choice import (
    LEARN,
    MARGIN,
    PIECES,
    WHOLE,
    PieceChoice,
    way_from_env,
)
from kvpool.storage.piece_read import PIECED_MIN, PieceReader
from kvpool.storage.ssd_tier import SsdTier

MiB = 1 << 20
K1M = PIECED_MIN.bit_length()


class _Disk:
    """A fake clock and the reads it times: a pieced read costs ``pieced_ns`` per
    byte, a whole one ``whole_ns``; ``ways`` records each read's way in order."""

    def __init__(self, pieced_ns: float, whole_ns: float) -> None:
        self.now = 0
        self.pieced_ns, self.whole_ns = pieced_ns, whole_ns
        self.ways: list[bool] = []
        self.clock_reads = 0

    def clock(self) -> int:
        self.clock_reads += 1
        return self.now

    def reader(self, nbytes: int, valid: bool = True) -> Any:
        def read(pieced: bool) -> bool:
            self.ways.append(pieced)
            self.now += int(nbytes * (self.pieced_ns if pieced else self.whole_ns))
            return valid

        return read


def _choice(disk: _Disk, trials: int = 4, coin: list[bool] | None = None) -> PieceChoice:
    tosses = iter(coin or [True] * 100)
    return PieceChoice(trials=trials, clock=disk.clock, coin=lambda: next(tosses))


def test_classes_below_pieced_min_read_whole_and_the_rest_learn() -> None:
    choice = PieceChoice()
    assert choice.ways[:K1M] == [WHOLE] * K1M
    assert choice.ways[K1M:] == [LEARN] * (65 - K1M)
    assert choice.describe() == ""  # nothing read yet


def test_trials_go_in_pairs_in_the_coins_order_then_the_class_settles_once() -> None:
    disk = _Disk(pieced_ns=1.0, whole_ns=0.5)  # one read twice as fast
    choice = _choice(disk, trials=3, coin=[True, False, True])
    for _ in range(6):
        assert choice.run(MiB, disk.reader(MiB))
    # pairs: the coin picks who goes first, the other way follows
    assert disk.ways == [True, False, False, True, True, False]
    assert choice.ways[K1M] == WHOLE
    assert choice.describe() == "1MiB: one read (pieces 0.50x)"
    assert choice.way_of(MiB + 4096) == "one read (pieces 0.50x)"
    assert choice.way_of(2 * MiB) == "learning"
    clock_reads = disk.clock_reads
    for _ in range(4):  # settled: no more timing, always one read
        assert choice.run(MiB + 4096, disk.reader(MiB + 4096))
    assert disk.ways[6:] == [False] * 4 and disk.clock_reads == clock_reads
    assert choice.ways[K1M + 1] == LEARN  # 2 MiB is another class, still learning


@pytest.mark.parametrize(
    ("whole_ns", "way"),
    [(1.0, PIECES), (1 / MARGIN + 0.001, PIECES), (1 / MARGIN - 0.01, WHOLE), (2.0, PIECES)],
)
def test_pieces_are_kept_unless_one_read_is_clearly_faster(whole_ns: float, way: int) -> None:
    disk = _Disk(pieced_ns=1.0, whole_ns=whole_ns)
    choice = _choice(disk, trials=2)
    for _ in range(4):
        choice.run(4 * MiB, disk.reader(4 * MiB))
    assert choice.ways[(4 * MiB).bit_length()] == way


def test_a_failed_or_raising_read_is_not_a_sample() -> None:
    disk = _Disk(pieced_ns=1.0, whole_ns=0.1)
    choice = _choice(disk, trials=1)
    assert not choice.run(MiB, disk.reader(MiB, valid=False))  # a checksum miss: answered

    def raising(pieced: bool) -> bool:
        raise OSError(5, "EIO")

    with pytest.raises(OSError):
        choice.run(MiB, raising)
    assert choice.ways[K1M] == LEARN
    assert choice.run(MiB, disk.reader(MiB)) and choice.run(MiB, disk.reader(MiB))
    assert choice.ways[K1M] == WHOLE  # settled on the two good samples alone


def test_a_fixed_way_learns_nothing() -> None:
    disk = _Disk(pieced_ns=1.0, whole_ns=0.1)
    fixed = PieceChoice(PIECES, clock=disk.clock)
    for size in (MiB, 16 * MiB):
        assert fixed.run(size, disk.reader(size))
    assert disk.ways == [True, True] and disk.clock_reads == 0
    assert fixed.describe() == fixed.way_of(16 * MiB) == "pieces ($KVPOOL_SSD_READS)"
    assert PieceChoice(WHOLE).describe() == "one read ($KVPOOL_SSD_READS)"
    assert fixed.way_of(PIECED_MIN - 4096) == "one read (below pieces)"


def test_bad_arguments_and_environment_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="trials must be at least 1"):
        PieceChoice(trials=0)
    with pytest.raises(ValueError, match="way must be PIECES, WHOLE or LEARN"):
        PieceChoice(7)
    for text, way in [("pieces", PIECES), (" Whole ", WHOLE), ("learn", LEARN)]:
        monkeypatch.setenv("KVPOOL_SSD_READS", text)
        assert way_from_env() == way
    monkeypatch.delenv("KVPOOL_SSD_READS")
    assert way_from_env() == LEARN
    monkeypatch.setenv("KVPOOL_SSD_READS", "halves")
    with pytest.raises(ValueError, match=r"KVPOOL_SSD_READS must be one of pieces, whole, learn"):
        way_from_env()


# -- the SSD tier, every way ---------------------------------------------------------


def test_a_tier_refuses_a_bad_kvpool_ssd_reads_and_leaves_its_directory_usable(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bad value is refused before the directory is locked or a file opened: the
    blocks stored there before are all still read back once the variable is fixed."""
    tier, _, blocks = ssd_tier_holding(str(tmp_path / "tier"), [PIECED_MIN, 4096])
    tier.close()
    monkeypatch.setenv("KVPOOL_SSD_READS", "halves")
    with pytest.raises(ValueError, match="KVPOOL_SSD_READS must be one of"):
        SsdTier(str(tmp_path / "tier"), 64 * MiB, make_policy("lru"))
    monkeypatch.setenv("KVPOOL_SSD_READS", "whole")
    tier = SsdTier(str(tmp_path / "tier"), 64 * MiB, make_policy("lru"))
    try:
        found = dict(tier.load_records())
        assert len(found) == 2
        for i, block in enumerate(blocks):
            out = aligned(-(-block.nbytes // 4096) * 4096, 0)
            assert tier.read_into(found[bytes([i]) * 16], out)
            assert np.array_equal(out[: block.nbytes], block)
    finally:
        tier.close()


def test_a_learning_tier_reads_and_copies_on_exact_before_and_after_it_settles(
    tmp_path: Any,
) -> None:
    """Forty 1 MiB-class reads (the class settles after 32), alternating whole reads
    and hits of ranges: every byte exact whichever way each read went."""
    size = MiB + 12_345
    tier, records, blocks = ssd_tier_holding(str(tmp_path / "tier"), [size, size])
    try:
        staging = aligned(-(-size // 4096) * 4096, 0)
        for n in range(40):
            i = n % 2
            if n % 4 < 2:
                assert tier.read_into(records[i], staging)
                assert np.array_equal(staging[:size], blocks[i])
            else:
                start, length = (n * 77_777) % size, 300_000
                length = min(length, size - start)
                dst = np.zeros(length, np.uint8)
                assert tier.read_copying(records[i], staging, dst, start, length)
                assert np.array_equal(dst, blocks[i][start : start + length])
        ways = tier.piece_choice.describe()
        if PieceReader.open() is not None:  # where pieces cannot run, both ways read whole
            assert ways.startswith("1MiB: ") and "learning" not in ways
    finally:
        tier.close()


@pytest.mark.parametrize("way", ["pieces", "whole"])
def test_either_fixed_way_reads_exact_and_a_corrupt_block_is_a_miss(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    monkeypatch.setenv("KVPOOL_SSD_READS", way)
    sizes = [PIECED_MIN, 4 * MiB + 7, 16 * MiB]
    tier, records, blocks = ssd_tier_holding(str(tmp_path / "tier"), sizes)
    try:
        name = "pieces" if way == "pieces" else "one read"
        assert tier.piece_choice.describe() == f"{name} ($KVPOOL_SSD_READS)"
        for record, block in zip(records, blocks, strict=True):
            staging = aligned(-(-block.nbytes // 4096) * 4096, 0)
            dst = np.zeros(block.nbytes - 5, np.uint8)
            assert tier.read_copying(record, staging, dst, 5, dst.nbytes)
            assert np.array_equal(dst, block[5:])
        with open(tmp_path / "tier" / "data.bin", "r+b") as f:  # flip a byte of block 1
            f.seek(records[1].offset + 3 * MiB)
            byte = f.read(1)
            f.seek(records[1].offset + 3 * MiB)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.sync()
        assert not tier.read_into(records[1], aligned(5 * MiB, 0))
    finally:
        tier.close()


def test_a_pools_stats_say_how_its_large_ssd_reads_go(tmp_path: Any) -> None:
    from kvpool import Namespace, Pool, block_keys

    keys = block_keys(np.arange(4), Namespace("ways"), block_tokens=1)
    with Pool.embedded(dram_bytes=2 * MiB, ssd_path=str(tmp_path), ssd_bytes=16 * MiB) as pool:
        for i, key in enumerate(keys):
            assert pool.put(key, aligned(MiB, 60 + i))
        assert pool.stats()["tiers"]["ssd"]["read_ways"] == ""  # nothing read from SSD yet
        out = np.empty(MiB, np.uint8)
        assert pool.get_into(keys[0], out) == MiB  # demoted first: read back from SSD
        assert pool.stats()["tiers"]["ssd"]["read_ways"] == "1MiB: learning"
