"""``kvpool bench local``: put / get_into per tier against memcpy and raw O_DIRECT.

DRAM: ``Pool.put`` and ``Pool.get_into`` against ``np.copyto`` between the
same kind of pre-faulted buffers. SSD: the SSD tier's own store (O_DIRECT
write + checksum + index commit) and read (O_DIRECT read + checksum check),
the exact code the pool runs when it demotes and promotes, against dd-style
O_DIRECT ``pwrite``/``preadv`` of the same sizes on the same filesystem. SSD hit
(path ``ssd-hit``): what a pool's ``get_into`` of a block on SSD runs, the read
into a DRAM-like slot and the copy on into the caller's buffer
(``SsdTier.read_copying``), against the same raw read.

DRAM ops alternate round by round (``interleaved``). SSD ops alternate block
by block (``item_by_item``: every op on block i, in balanced orders, then
block i+1), since this class's virtual disk drifts within the second a round
of 256 MiB takes and a round-level alternation let that drift decide a cell.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile

import numpy as np

from kvpool.bench.common import (
    Row,
    count_for,
    faulted,
    interleaved,
    item_by_item,
    make_row,
    page_rounded,
)
from kvpool.config import format_size
from kvpool.embedded.pool import Pool
from kvpool.eviction import make_policy
from kvpool.index.keys import Namespace, block_keys
from kvpool.storage.ssd_record import SsdRecord
from kvpool.storage.ssd_tier import SsdTier


def run_local(
    sizes: list[int],
    tiers: list[str],
    ssd_dir: str | None,
    rounds: int,
    read_ways: list[str] | None = None,
) -> list[Row]:
    """The rows; ``read_ways`` gets how each size's SSD reads went (in pieces or as
    one read, as its tier learned: ``SsdTier.piece_choice``)."""
    rows: list[Row] = []
    for size in sizes:
        if "dram" in tiers:
            rows += _dram_rows(size, rounds)
        if "ssd" in tiers:
            rows += _ssd_rows(size, rounds, ssd_dir, read_ways)
    return rows


def _keys(n: int) -> list[bytes]:
    return block_keys(np.arange(n * 4), Namespace("bench"), block_tokens=4)


def _dram_rows(size: int, rounds: int) -> list[Row]:
    count = count_for(size)
    sources = [faulted(size) for _ in range(count)]
    outs = [faulted(size, fill=0) for _ in range(count)]
    keys = _keys(count)
    with Pool.embedded(dram_bytes=count * page_rounded(size)) as pool:

        def remove_all() -> None:
            for key in keys:
                pool.remove(key)

        ops = {
            "put": lambda i: pool.put(keys[i], sources[i]),
            "copy": lambda i: np.copyto(outs[i], sources[i]),
            "get": lambda i: pool.get_into(keys[i], outs[i]),
        }
        timings = interleaved(size, ops, count, rounds, {"put": remove_all})
    put, copy, get = timings["put"], timings["copy"], timings["get"]
    return [
        make_row("put", "dram", put, copy, "numpy copy"),
        make_row("get_into", "dram", get, copy, "numpy copy"),
    ]


def _ssd_rows(
    size: int, rounds: int, ssd_dir: str | None, read_ways: list[str] | None
) -> list[Row]:
    count = count_for(size, working_set=256 << 20, lo=8, hi=256)
    rounded = page_rounded(size)
    aligned = _aligned_buffer(count * rounded)  # page-aligned, like arena slots
    slots = [aligned[i * rounded : (i + 1) * rounded] for i in range(count)]
    keys = _keys(count)
    root = tempfile.mkdtemp(prefix="kvpool-bench-ssd-", dir=ssd_dir)
    tier = SsdTier(os.path.join(root, "tier"), count * rounded, make_policy("lru"))
    raw = os.open(os.path.join(root, "raw.bin"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    records: list[SsdRecord | None] = [None] * count
    outs = [faulted(size, fill=0) for _ in range(count)]  # the callers' buffers of SSD hits
    try:
        os.posix_fallocate(raw, 0, count * rounded)

        def store(i: int) -> None:
            records[i] = tier.store(keys[i], slots[i], size, None)

        def drop(i: int) -> None:  # untimed, before each put of block i
            record = records[i]
            if record is not None:
                tier.delete(keys[i])
                tier.free(record.offset)
                records[i] = None

        def load(i: int) -> None:
            record = records[i]
            assert record is not None and tier.read_into(record, slots[i])

        def hit(i: int) -> None:
            record = records[i]
            assert record is not None and tier.read_copying(record, slots[i], outs[i], 0, size)

        ops = {
            "put": store,
            "raw_write": lambda i: os.pwrite(raw, slots[i].data, i * rounded),
            "get": load,
            "raw_read": lambda i: os.preadv(raw, [slots[i].data], i * rounded),
            "hit": hit,
        }
        t = item_by_item(size, ops, count, rounds, {"put": drop})
        if read_ways is not None:
            read_ways.append(f"{format_size(size)}: {tier.piece_choice.way_of(rounded)}")
    finally:
        os.close(raw)
        tier.close()
        shutil.rmtree(root, ignore_errors=True)
    return [
        make_row("put", "ssd", t["put"], t["raw_write"], "O_DIRECT pwrite"),
        make_row("get_into", "ssd", t["get"], t["raw_read"], "O_DIRECT pread"),
        make_row("get_into", "ssd-hit", t["hit"], t["raw_read"], "O_DIRECT pread"),
    ]


def _aligned_buffer(nbytes: int) -> np.ndarray:
    """Anonymous page-aligned memory, pre-faulted."""
    region = mmap.mmap(-1, nbytes)
    array = np.frombuffer(region, dtype=np.uint8)
    array[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    return array
