"""``kvpool bench copy``: the copy every large block takes, against numpy's copy.

kvpool copies blocks of 4 MiB and more with streaming stores, and from 64 KiB
whichever of streaming and numpy's copy the process's first copies of the size
timed faster (kvpool.bindings.stream_copy, copy_choice); numpy (glibc) copies
through the caches. This suite times both on the same buffers, op by op in
interleaved rounds (``paired``), in two settings, to see where streaming pays on
a machine (and to choose ``$KVPOOL_STREAM_MIN``, which fixes the bound):

- ``cold``: a working set far bigger than the caches, as a pool moving many
  blocks sees it (the pool's put and get rows run so);
- ``hot``: four blocks, copied again and again, so they stay in the caches:
  numpy's best case, where streaming loses while the blocks fit in L2.

``ratio`` is numpy's time over ours: above 1, the pool's copy is faster.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.args import positive_int, sizes_arg
from kvpool.bench.common import count_for, faulted, paired, write_json
from kvpool.config import format_size

COLD_SET = 128 << 20  # bytes rotated through per size: four times this host's L3


@dataclass
class CopyRow:
    size: int
    setting: str  # cold or hot
    kernel: str  # kvpool.bindings.stream_copy.STATUS
    stream_gbps: float
    numpy_gbps: float
    ratio: float  # stream over numpy throughput: higher is better


def run_copy(sizes: list[int], rounds: int) -> list[CopyRow]:
    """One row per size and setting; raises if the extension is not built."""
    from kvpool.bindings import stream_copy

    kernel = stream_copy.kernel_or_none()
    if kernel is None:
        raise RuntimeError(f"no streaming copy to measure: {stream_copy.STATUS}")
    rows = []
    for size in sizes:
        for setting, count in (("cold", count_for(size, COLD_SET)), ("hot", 4)):
            numpy_t, stream_t = _time_both(kernel, size, count, rounds)
            stream_gbps = size / stream_t / 1e9
            numpy_gbps = size / numpy_t / 1e9
            rows.append(
                CopyRow(
                    size,
                    setting,
                    stream_copy.STATUS,
                    round(stream_gbps, 2),
                    round(numpy_gbps, 2),
                    round(stream_gbps / numpy_gbps, 3),
                )
            )
    return rows


def _time_both(
    kernel: Callable[[np.ndarray, np.ndarray], None], size: int, count: int, rounds: int
) -> tuple[float, float]:
    """Median seconds per copy of ``count`` distinct blocks: (numpy's, the kernel's);
    raises if a streamed copy left its destination unequal to its source."""
    srcs = [faulted(size) for _ in range(count)]
    dsts = [faulted(size, fill=0) for _ in range(count)]

    def ours(i: int) -> None:
        kernel(dsts[i], srcs[i])

    def numpy_copy(i: int) -> None:
        dsts[i][...] = srcs[i]

    base, mine = paired(size, numpy_copy, ours, count, rounds)
    for i in range(count):
        ours(i)
        if not np.array_equal(dsts[i], srcs[i]):
            raise RuntimeError("the streaming copy left a destination unequal to its source")
    return float(np.median(base.latencies)), float(np.median(mine.latencies))


def register_copy(suites: Any) -> None:
    parser = suites.add_parser("copy", help="the streaming copy of large blocks vs numpy's copy")
    parser.add_argument("--sizes", type=sizes_arg, default="16KiB,64KiB,256KiB,1MiB,4MiB,16MiB")
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--json", default=None, metavar="F")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    rows = run_copy(args.sizes, args.rounds)
    print(rows[0].kernel if rows else "")
    print(f"{'size':>8} {'setting':<7} {'stream GB/s':>11} {'numpy GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(
            f"{format_size(r.size):>8} {r.setting:<7} {r.stream_gbps:>11.2f} "
            f"{r.numpy_gbps:>10.2f} {r.ratio:>6.2f}"
        )
    write_json(args.json, rows)
    return 0
