"""Which copy each block size takes (kvpool.bindings.copy_choice, issue 17).

The learner with an injected clock: trials alternate the two ways, a class
settles after ``trials`` timings each way on the faster one (its preferred way
kept within ``MARGIN``: streaming for puts, numpy's copy for reads), settles
once and never again, copies exactly on every trial, and without a kernel never
streams. The table of ways: numpy's copy below 64 KiB, learning up to
``LEARN_BELOW``, streaming above, or a fixed bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.bindings.copy_choice import (
    LEARN,
    LEARN_BELOW,
    MARGIN,
    NUMPY,
    STREAM,
    STREAM_MIN,
    CopyChoice,
    class_of,
    initial_ways,
)

K64 = class_of(STREAM_MIN)


class _Clock:
    """A fake ``perf_counter_ns``: each copy takes ``cost(way)`` ns per byte."""

    def __init__(self, stream_ns: float, numpy_ns: float) -> None:
        self.now = 0
        self.costs = {"stream": stream_ns, "numpy": numpy_ns}
        self.way = "numpy"  # set by the copy that runs, read when it ends
        self.nbytes = 0
        self.started = False

    def __call__(self) -> int:
        if self.started:  # the copy's end: advance by its cost
            self.now += int(self.costs[self.way] * self.nbytes)
        self.started = not self.started
        return self.now


def _rig(
    stream_ns: float,
    numpy_ns: float,
    trials: int = 4,
    coin_first: bool = True,
    prefer: int = STREAM,
) -> tuple[CopyChoice, _Clock, list[int]]:
    """A learner on a fake clock; each pair's first copy streams (``coin_first``) or not."""
    clock = _Clock(stream_ns, numpy_ns)
    streamed: list[int] = []

    def kernel(dst: np.ndarray, src: np.ndarray) -> None:
        streamed.append(src.nbytes)
        clock.way = "stream"
        dst[...] = src

    choice = CopyChoice(
        kernel,
        initial_ways(True, None),
        prefer=prefer,
        trials=trials,
        clock=clock,
        coin=lambda: coin_first,
    )
    real_trial = choice.trial_copy

    def trial(dst: np.ndarray, src: np.ndarray) -> None:  # tell the clock the size
        clock.way, clock.nbytes = "numpy", src.nbytes
        real_trial(dst, src)

    choice.trial_copy = trial  # type: ignore[method-assign]
    return choice, clock, streamed


def _copy_n(copy: Callable[[np.ndarray, np.ndarray], None], n: int, size: int) -> None:
    rng = np.random.default_rng(size)
    for i in range(n):
        src = rng.integers(0, 256, size + i, dtype=np.uint8)
        dst = np.zeros_like(src)
        copy(dst, src)
        assert np.array_equal(dst, src), i


def test_the_table_numpy_below_64k_learning_in_between_streaming_from_learn_below() -> None:
    ways = initial_ways(True, None)
    assert ways[class_of(0)] == ways[class_of(1)] == ways[class_of(STREAM_MIN - 1)] == NUMPY
    assert ways[class_of(STREAM_MIN)] == ways[class_of(LEARN_BELOW - 1)] == LEARN
    assert ways[class_of(LEARN_BELOW)] == ways[class_of(1 << 40)] == STREAM
    fixed = initial_ways(True, 1 << 20)  # $KVPOOL_STREAM_MIN: nothing learns
    assert LEARN not in fixed
    assert fixed[class_of((1 << 20) - 1)] == NUMPY and fixed[class_of(1 << 20)] == STREAM
    assert set(initial_ways(False, None)) == set(initial_ways(False, 1 << 20)) == {NUMPY}
    assert len(ways) == 65  # every int64 size has a class


def test_trials_alternate_and_a_class_where_numpy_wins_settles_on_numpy() -> None:
    choice, _, streamed = _rig(stream_ns=0.14, numpy_ns=0.10)  # streaming 0.71x
    _copy_n(choice.trial_copy, 7, STREAM_MIN)
    assert choice.ways[K64] == LEARN and len(streamed) == 4  # stream, numpy, stream, ...
    _copy_n(choice.trial_copy, 1, STREAM_MIN)
    assert choice.ways[K64] == NUMPY
    assert choice.describe().startswith("64KiB: numpy copy (streaming 0.71x); 128KiB: learning")
    assert all(choice.ways[k] == LEARN for k in range(K64 + 1, class_of(LEARN_BELOW)))


@pytest.mark.parametrize(
    ("stream_ns", "numpy_ns", "way"),
    [
        (0.07, 0.10, STREAM),  # streaming faster
        (0.10, 0.10, STREAM),  # level
        (0.104, 0.10, STREAM),  # numpy faster, within the margin: streaming kept
        (0.10 * MARGIN * 1.01, 0.10, NUMPY),  # past the margin
    ],
)
def test_streaming_is_kept_unless_numpy_is_clearly_faster(
    stream_ns: float, numpy_ns: float, way: int
) -> None:
    choice, _, _ = _rig(stream_ns, numpy_ns)
    _copy_n(choice.trial_copy, 8, 1 << 20)
    assert choice.ways[class_of(1 << 20)] == way


@pytest.mark.parametrize(
    ("stream_ns", "numpy_ns", "way"),
    [
        (0.14, 0.10, NUMPY),  # numpy faster
        (0.10, 0.10, NUMPY),  # level
        (0.10 / 1.04, 0.10, NUMPY),  # streaming faster, within the margin: numpy's kept
        (0.10 / (MARGIN * 1.01), 0.10, STREAM),  # past the margin
    ],
)
def test_a_learner_preferring_numpy_streams_only_where_streaming_is_clearly_faster(
    stream_ns: float, numpy_ns: float, way: int
) -> None:
    """The reads' learner (kvpool.bindings.stream_copy): a near tie goes to numpy's copy."""
    choice, _, _ = _rig(stream_ns, numpy_ns, prefer=NUMPY)
    _copy_n(choice.trial_copy, 8, 1 << 20)
    assert choice.ways[class_of(1 << 20)] == way


def test_a_learner_prefers_one_of_the_two_ways() -> None:
    with pytest.raises(ValueError, match="prefer must be STREAM or NUMPY"):
        CopyChoice(lambda d, s: None, initial_ways(True, None), prefer=LEARN)


def test_a_settled_class_never_changes_and_other_classes_learn_on_their_own() -> None:
    choice, clock, _ = _rig(stream_ns=0.2, numpy_ns=0.1)
    _copy_n(choice.trial_copy, 8, STREAM_MIN)
    assert choice.ways[K64] == NUMPY
    clock.costs = {"stream": 0.01, "numpy": 1.0}  # the machine "changes": too late
    _copy_n(choice.trial_copy, 8, 2 * STREAM_MIN)
    assert choice.ways[K64] == NUMPY and choice.ways[K64 + 1] == STREAM
    choice._settle(K64)  # a second settle (two threads finishing together) is a no-op
    assert choice.ways[K64] == NUMPY


def test_the_coin_picks_which_way_goes_first_in_each_pair() -> None:
    choice, _, streamed = _rig(stream_ns=0.1, numpy_ns=0.1, coin_first=False)
    _copy_n(choice.trial_copy, 3, STREAM_MIN)  # numpy, stream, numpy
    assert len(streamed) == 1


def test_a_disturbance_every_other_copy_falls_on_both_ways() -> None:
    """Every second copy stalls (as a background refill every second put would):
    with strict alternation all stalls would land on streaming and settle the class
    on numpy's copy; the seeded coin spreads them, and the faster way wins."""
    clock = _Clock(stream_ns=0.08, numpy_ns=0.10)
    copies = 0

    def kernel(dst: np.ndarray, src: np.ndarray) -> None:
        clock.way = "stream"
        dst[...] = src

    choice = CopyChoice(kernel, initial_ways(True, None), trials=16, clock=clock)

    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        nonlocal copies
        base = {"stream": 0.08, "numpy": 0.10}
        clock.costs = {k: v * (3 if copies % 2 == 0 else 1) for k, v in base.items()}
        clock.way, clock.nbytes = "numpy", src.nbytes
        choice.trial_copy(dst, src)
        copies += 1

    _copy_n(copy, 32, STREAM_MIN)
    assert choice.ways[K64] == STREAM


def test_outliers_move_neither_median() -> None:
    """One stalled copy each way (a page fault, a preemption) does not decide."""
    choice, clock, _ = _rig(stream_ns=0.08, numpy_ns=0.10)
    copies = 0

    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        nonlocal copies
        stalled = copies in (0, 3)  # the first streamed and the second numpy copy
        saved = dict(clock.costs)
        if stalled:
            clock.costs = {k: v * 50 for k, v in saved.items()}
        choice.trial_copy(dst, src)
        clock.costs = saved
        copies += 1

    _copy_n(copy, 8, STREAM_MIN)
    assert choice.ways[K64] == STREAM


def test_without_a_kernel_nothing_learns_or_streams() -> None:
    choice = CopyChoice(None, initial_ways(False, None))
    assert set(choice.ways) == {NUMPY} and choice.describe() == ""
    with pytest.raises(ValueError, match="without a streaming kernel no size class can learn"):
        CopyChoice(None, initial_ways(True, None))


def test_threads_copying_at_once_stay_exact_and_settle_each_class_once() -> None:
    choice = CopyChoice(lambda d, s: np.copyto(d, s), initial_ways(True, None), trials=16)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for i in range(200):
                src = rng.integers(0, 256, STREAM_MIN + i, dtype=np.uint8)
                dst = np.zeros_like(src)
                choice.trial_copy(dst, src) if choice.ways[K64] == LEARN else np.copyto(dst, src)
                assert np.array_equal(dst, src)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert choice.ways[K64] in (NUMPY, STREAM)
    assert choice.describe().startswith("64KiB: ")
