"""Same-host checked read vs plain copy, in one process (no node, no master).

``kvpool bench remote --transport shm`` measures the whole get_into against
a numpy copy, but on a loaded 2-core machine its run-to-run noise (+-15%)
hides a cost of a few microseconds. This isolates the identity check
(kvpool.transport.shm_ident): the same ShmTransport copies the same block
with ``read_into`` (no check) and ``read_block`` (check before and after),
interleaved in rounds; it prints the median time of each and their ratio.

    .venv/bin/python bench/shm_check.py [--sizes 64KiB,1MiB,4MiB] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvpool.cluster.block_table import BlockTable
from kvpool.config import parse_size
from kvpool.storage.arena import SharedArena
from kvpool.transport.base import RegionInfo, host_identity
from kvpool.transport.fencing import WriteStamp
from kvpool.transport.shm import ShmTransport, shm_path
from kvpool.transport.shm_ident import BlockIdents, ident_name

KEY = b"\x07" * 16


def measure(size: int, rounds: int, reps: int) -> tuple[float, float]:
    arena = SharedArena(size)
    idents = BlockIdents(shm_path(ident_name(arena.name)), arena.size, create=True)
    table = BlockTable(lambda offset, n: 0, idents=idents)
    table.new_term(1)
    stamp = WriteStamp(1, 1, 0, size, KEY)
    table.claim(stamp, "bench")
    table.finish(stamp, "bench", ok=True, seal=True)
    info = RegionInfo("bench", arena.size, shm_name=arena.name, host_id=host_identity())
    shm = ShmTransport(info)
    out = np.ones(size, np.uint8)
    plain: list[float] = []
    checked: list[float] = []
    try:
        for r in range(rounds):  # interleaved, each side first in every other round
            for side in (0, 1) if r % 2 else (1, 0):
                t0 = time.perf_counter()
                if side:
                    for _ in range(reps):
                        assert shm.read_block(0, 0, out, KEY)
                else:
                    for _ in range(reps):
                        shm.read_into(0, out)
                (checked if side else plain).append((time.perf_counter() - t0) / reps)
    finally:
        shm.close()
        idents.close()
        arena.close()
    return statistics.median(plain), statistics.median(checked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"{'size':>8} {'copy us':>9} {'checked us':>11} {'ratio':>6}")
    for text in args.sizes.split(","):
        size = parse_size(text)
        reps = max(5, (64 << 20) // size // 8)
        plain, checked = measure(size, args.rounds, reps)
        print(f"{text:>8} {plain * 1e6:9.1f} {checked * 1e6:11.1f} {plain / checked:6.2f}")


if __name__ == "__main__":
    main()
