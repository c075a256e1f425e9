"""Which host copy each block size takes on this machine, learned from its first copies.

Streaming stores (``kvpool.bindings._stream_copy``) beat numpy's copy by 1.2-1.7x
from 64 KiB on one class of 2 vCPU AMD EPYC VM, and lose to it (0.72x at 64 KiB,
0.91x at 256 KiB) on another with twice the memory bandwidth (bench/RESULTS.md,
"Session 10" and "Session 18"): no fixed size is right on both. Nor is a synthetic
calibration: back-to-back copies of one contiguous range read 64 KiB streaming as
0.89-1.00x numpy's copy on the second VM, where the pool's own copies, a few
microseconds of bookkeeping apart, ran it at 0.72x. What wins depends on what runs
between the copies, so the copies themselves are timed.

Sizes fall in power-of-two classes (all sizes with the same ``int.bit_length()``).
A class below ``STREAM_MIN`` always takes numpy's copy; one from ``LEARN_BELOW`` up
always streams (level with numpy's copy or faster on both VM classes); in between,
the class's first ``2 * TRIALS`` copies go in pairs, one each way in an order a coin
decides, each timed, and then the class settles for the rest of the process on
the learner's preferred way (``prefer``) unless the other way's median time per
byte beat it by more than ``MARGIN`` (clearly faster). ``kvpool.bindings.stream_copy``
keeps one ``CopyChoice`` for puts' copies, preferring streaming (the destination is
the node's arena, which this core never reads back: streaming leaves the caller's
caches alone, which its own time does not show), and one for reads', preferring
numpy's copy (the destination is the caller's buffer, which it reads next; and
out of a node's arena here numpy's copy read 1 MiB blocks at 0.90x a plain copy
where streaming read them at 0.84x, while a read class's first copies timed the
two level or streaming ahead; bench/RESULTS.md, "Session 23"). A class is never
re-opened: a process whose first copies ran beside unrepresentative load keeps
their verdict (``$KVPOOL_STREAM_MIN`` overrides it); re-timing later would put a
clock read on every copy.

Invariants:
- every copy, timed or not, leaves ``dst`` byte-equal to ``src``, and both ways are
  ordered before the caller's next store (the kernel's SFENCE; numpy's plain stores);
- ``ways[k]`` is ``NUMPY``, ``STREAM`` or ``LEARN`` for sizes with bit_length ``k``; a
  class leaves ``LEARN`` once, and its way never changes after that;
- without a kernel no class streams or learns.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from statistics import median

import numpy as np

from kvpool.config import format_size

NUMPY, STREAM, LEARN = 0, 1, 2

#: copies smaller than this never stream: below 64 KiB the gain (0.1-0.5 us a copy on
#: the VMs where streaming wins) is about what the call costs over numpy's copy.
STREAM_MIN = 64 << 10
#: copies of at least this many bytes always stream where the kernel exists: there
#: streaming ran level with numpy's copy or faster on every VM measured (0.98-1.05x on
#: the faster-memory one, 1.3-1.7x on the other; ``kvpool bench copy``; same-host puts
#: of 16 MiB 1.03-1.04x a numpy copy streamed, 0.83-0.84x not), and a copy that large
#: through the caches would evict the caller's working set. Up to 16 MiB the classes
#: learn: into and out of a node's shared arena (4 KiB pages) numpy's copy won at 4 and
#: 8 MiB (same-host put 4 MiB 0.92-0.93x a numpy copy against 0.85-0.92x streamed,
#: get_into 8 MiB 0.95-0.96x against 0.87-0.91x; issue 17, session 20).
LEARN_BELOW = 32 << 20
#: timed copies each way before a class settles (medians of 16: a stray page fault
#: or preemption moves neither).
TRIALS = 16
#: a learner's preferred way is kept unless the other beat it by more than this factor.
MARGIN = 1.05

Kernel = Callable[[np.ndarray, np.ndarray], None]


def class_of(nbytes: int) -> int:
    """The size class of a copy of ``nbytes``: the index into ``CopyChoice.ways``."""
    return nbytes.bit_length()


def initial_ways(has_kernel: bool, stream_from: int | None) -> list[int]:
    """The way of each size class before any copy: with ``stream_from`` (a power of
    two, ``$KVPOOL_STREAM_MIN``) a fixed bound and nothing learned, else ``LEARN``
    between ``STREAM_MIN`` and ``LEARN_BELOW``."""
    ways = []
    for k in range(65):
        smallest = 1 << (k - 1) if k else 0  # the class's smallest size
        if not has_kernel:
            ways.append(NUMPY)
        elif stream_from is not None:
            ways.append(STREAM if smallest >= stream_from else NUMPY)
        elif smallest < STREAM_MIN:
            ways.append(NUMPY)
        else:
            ways.append(LEARN if smallest < LEARN_BELOW else STREAM)
    return ways


def _seeded_coin() -> Callable[[], bool]:
    """A fair coin, the same sequence in every process (runs reproduce)."""
    draw = random.Random(17).random
    return lambda: draw() < 0.5


class CopyChoice:
    """The way each size class copies, and the timed trials of the classes still learning.

    ``ways`` is read without a lock on every copy (a list item: one atomic load); it
    is written once per class, under ``_lock``, by the copy that completes the trials.
    Trial samples are appended without the lock: two threads finishing together
    settle the class once (the second finds it settled).
    """

    def __init__(
        self,
        kernel: Kernel | None,
        ways: list[int],
        *,
        prefer: int = STREAM,
        trials: int = TRIALS,
        clock: Callable[[], int] = time.perf_counter_ns,
        coin: Callable[[], bool] | None = None,
    ) -> None:
        if kernel is None and (LEARN in ways or STREAM in ways):
            raise ValueError("without a streaming kernel no size class can learn or stream")
        if prefer not in (STREAM, NUMPY):
            raise ValueError(f"prefer must be STREAM or NUMPY, not {prefer!r}")
        self.ways = ways
        self._prefer = prefer
        self._kernel = kernel
        self._trials = trials
        self._clock = clock
        self._coin = coin or _seeded_coin()
        self._lock = threading.Lock()
        # per learning class: ns per byte of its timed copies, (streamed, numpy's)
        self._samples: dict[int, tuple[list[float], list[float]]] = {
            k: ([], []) for k, way in enumerate(ways) if way == LEARN
        }
        self._speeds: dict[int, float] = {}  # settled class -> streaming's speed / numpy's

    def trial_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into ``dst`` (a learning class) one way or the other, timed;
        settle the class once it has ``trials`` timings each way."""
        kernel = self._kernel
        nbytes = src.nbytes
        k = class_of(nbytes)
        streamed, plain = self._samples[k]
        # trials go in pairs, one copy each way, the first of each pair by a coin
        # toss: a disturbance that recurs every other copy (a background refill
        # every second put) falls on either way alike, never on one of them only
        n_stream, n_plain = len(streamed), len(plain)
        stream_turn = self._coin() if n_stream == n_plain else n_stream < n_plain
        clock = self._clock
        start = clock()
        if stream_turn:
            kernel(dst, src)  # type: ignore[misc]  # a learning class has a kernel
        else:
            dst[...] = src
        per_byte = (clock() - start) / nbytes
        (streamed if stream_turn else plain).append(per_byte)
        if len(streamed) >= self._trials and len(plain) >= self._trials:
            self._settle(k)

    def _settle(self, k: int) -> None:
        with self._lock:
            if self.ways[k] != LEARN:
                return
            streamed, plain = self._samples[k]
            stream_ns, numpy_ns = median(streamed), median(plain)
            speed = numpy_ns / stream_ns if stream_ns > 0 else float("inf")
            self._speeds[k] = speed
            if self._prefer == STREAM:
                self.ways[k] = NUMPY if speed * MARGIN < 1 else STREAM
            else:
                self.ways[k] = STREAM if speed > MARGIN else NUMPY

    def describe(self) -> str:
        """The learning classes and what each settled on, e.g. ``64 KiB: numpy copy
        (streaming 0.72x); 128 KiB: learning`` (empty when nothing learns)."""
        parts = []
        for k in sorted(self._samples):
            size = format_size(1 << (k - 1))
            way = self.ways[k]
            if way == LEARN:
                parts.append(f"{size}: learning")
            else:
                name = "numpy copy" if way == NUMPY else "streaming"
                parts.append(f"{size}: {name} (streaming {self._speeds[k]:.2f}x)")
        return "; ".join(parts)
