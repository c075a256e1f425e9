"""Why the SSD tier keeps block bytes in an O_DIRECT data file (LMDB only indexes them).

``python -m kvpool.bench.ssd_choice [DIR]`` writes and reads the same 4 MiB
blocks (256 MiB in all) three ways on the same filesystem, dropping the page
cache before every read pass where the kernel allows it:
1. LMDB values (writemap, 16 puts per transaction, ``buffers=True`` reads
   copied out), 2. kvpool's SSD tier (O_DIRECT data file + LMDB index +
   checksums), 3. raw O_DIRECT pwrite/pread. Prints GB/s for each.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import time

import lmdb
import numpy as np

from kvpool.eviction import make_policy
from kvpool.storage.ssd_tier import SsdTier

BLOCK, COUNT = 4 << 20, 64


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _gbps(seconds: float) -> float:
    return BLOCK * COUNT / seconds / 1e9


def main(root: str | None = None) -> None:
    work = tempfile.mkdtemp(prefix="kvpool-ssd-choice-", dir=root)
    buf = np.frombuffer(mmap.mmap(-1, BLOCK), np.uint8)
    buf[:] = np.arange(BLOCK, dtype=np.uint64).astype(np.uint8)
    out = np.frombuffer(mmap.mmap(-1, BLOCK), np.uint8)
    out[:] = 0
    keys = [i.to_bytes(16, "little") for i in range(COUNT)]
    try:
        env = lmdb.open(
            os.path.join(work, "lmdb"),
            map_size=2 * BLOCK * COUNT,
            writemap=True,
            sync=False,
            metasync=False,
        )
        t = time.perf_counter()
        for start in range(0, COUNT, 16):
            with env.begin(write=True) as txn:
                for key in keys[start : start + 16]:
                    txn.put(key, buf.data)
        lmdb_put = _gbps(time.perf_counter() - t)
        cold = _drop_caches()
        t = time.perf_counter()
        with env.begin(buffers=True) as txn:
            for key in keys:
                value = txn.get(key)
                assert value is not None
                np.copyto(out, np.frombuffer(value, np.uint8))
        lmdb_get = _gbps(time.perf_counter() - t)
        env.close()

        tier = SsdTier(os.path.join(work, "tier"), BLOCK * COUNT, make_policy("lru"))
        t = time.perf_counter()
        records = [tier.store(key, buf, BLOCK, None) for key in keys]
        tier_put = _gbps(time.perf_counter() - t)
        _drop_caches()
        t = time.perf_counter()
        for record in records:
            assert record is not None and tier.read_into(record, out)
        tier_get = _gbps(time.perf_counter() - t)
        tier.close()

        fd = os.open(os.path.join(work, "raw"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(fd, 0, BLOCK * COUNT)
        t = time.perf_counter()
        for i in range(COUNT):
            os.pwrite(fd, buf.data, i * BLOCK)
        raw_put = _gbps(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(COUNT):
            os.preadv(fd, [out.data], i * BLOCK)
        raw_get = _gbps(time.perf_counter() - t)
        os.close(fd)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"page cache dropped before reads: {cold}")
    print(f"{'store':<28} {'write GB/s':>10} {'read GB/s':>10}")
    for name, w, r in (
        ("LMDB values (writemap)", lmdb_put, lmdb_get),
        ("kvpool SSD tier (O_DIRECT)", tier_put, tier_get),
        ("raw O_DIRECT", raw_put, raw_get),
    ):
        print(f"{name:<28} {w:>10.2f} {r:>10.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
