"""The SSD tier's native-AIO write path (kvpool.storage.direct_aio).

Real kernel AIO on a real file where this Linux offers it (the writer tests
skip elsewhere); the hold-back of a signal's exception and the lost-write rule
use a fake syscall / writer, since neither can be provoked on demand.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from poolhelpers import aligned

import kvpool.storage.direct_aio as aio_module
import kvpool.storage.ssd_tier as ssd_tier_module
from kvpool.errors import StorageError
from kvpool.eviction import make_policy
from kvpool.storage.aio_abi import IoEvent
from kvpool.storage.direct_aio import AioLost, DirectWriter
from kvpool.storage.ssd_tier import SsdTier

_PAGE = 4096

if aio_module._NATIVE is None and os.environ.get("KVPOOL_REQUIRE_AIO_NATIVE") == "1":
    pytest.fail(f"KVPOOL_REQUIRE_AIO_NATIVE=1 but SSD writes go {aio_module.STATUS}", pytrace=False)


#: Both ways of submitting and reaping: in C (kvpool.storage._aio_native) and ctypes.
WAYS = [pytest.param(True, id="native"), pytest.param(False, id="ctypes")]


def _writer(native: bool = False) -> DirectWriter:
    """A real writer; ``native``: the C submit / reap (skipped where not built),
    else the ctypes path, which the tests of its internals patch."""
    if native and aio_module._NATIVE is None:
        pytest.skip("kvpool.storage._aio_native is not built (or this is not x86_64)")
    writer = DirectWriter.open(native)
    if writer is None:
        pytest.skip("native AIO is not available here")
    assert writer.native == native
    return writer


def _direct_file(path: str, size: int) -> tuple[int, int]:
    plain = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(plain, 0, size)
    try:
        direct = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        os.close(plain)
        pytest.skip("no O_DIRECT on this filesystem")
    return plain, direct


def _writes_again(writer: DirectWriter, direct: int, plain: int, seed: int) -> None:
    """The writer takes another write after what a test did to it, and it lands."""
    again = aligned(64 << 10, seed)
    assert writer.submit(direct, again, 0) and writer.wait() == again.nbytes
    assert os.pread(plain, again.nbytes, 0) == again.tobytes()


def _assert_reopened(path: str, capacity: int, wanted: dict[bytes, np.ndarray]) -> None:
    """Reopen the tier at ``path``: its records name exactly ``wanted``'s keys, and each
    block reads back byte for byte."""
    tier = SsdTier(path, capacity, make_policy("lru"))
    try:
        records = dict(tier.load_records())
        assert set(records) == set(wanted)
        for key, data in wanted.items():
            out = aligned(-(-data.nbytes // _PAGE) * _PAGE, 0)
            assert tier.read_into(records[key], out)
            assert np.array_equal(out[: data.nbytes], data)
    finally:
        tier.close()


@pytest.mark.parametrize("native", WAYS)
def test_a_submitted_write_lands_whole_and_wait_reports_its_bytes(
    tmp_path: Any, native: bool
) -> None:
    writer = _writer(native)
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 4 << 20)
    try:
        data = aligned(1 << 20, 1)
        assert writer.submit(direct, data, 2 * _PAGE)
        assert writer.wait() == data.nbytes
        assert os.pread(plain, data.nbytes, 2 * _PAGE) == data.tobytes()
        again = aligned(3 * _PAGE, 2)  # the context takes the next write
        assert writer.submit(direct, again, 0)
        assert writer.wait() == again.nbytes
        assert os.pread(plain, again.nbytes, 0) == again.tobytes()
    finally:
        writer.close()
        writer.close()  # idempotent
        os.close(direct)
        os.close(plain)


@pytest.mark.parametrize("native", WAYS)
def test_a_misaligned_buffer_is_refused_and_nothing_stays_in_flight(
    tmp_path: Any, native: bool
) -> None:
    writer = _writer(native)
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    try:
        data = aligned(2 * _PAGE, 3)[1 : 1 + _PAGE]  # not page-aligned: O_DIRECT refuses
        if writer.submit(direct, data, 0):  # the kernel reports it at submit or at completion
            with pytest.raises(OSError) as err:
                writer.wait()
            assert err.value.errno == 22  # EINVAL
        good = aligned(_PAGE, 4)
        assert writer.submit(direct, good, 0)  # not stuck on the refused one
        assert writer.wait() == _PAGE
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


class _FakeSyscall:
    """io_getevents as a signal would interrupt it. ``completed_first=False``: the
    first call raises in Python (a handler's KeyboardInterrupt) before any
    completion, the second reports it. ``completed_first=True``: the completion is
    delivered and the handler's exception lands right after, before the caller saw
    the return value; a second call would block forever on a real kernel."""

    def __init__(self, writer: DirectWriter, completed_first: bool) -> None:
        self.writer, self.completed_first, self.calls = writer, completed_first, 0

    def __call__(self, *args: Any) -> int:
        self.calls += 1
        if self.completed_first:
            assert self.calls == 1, "waited again for a completion already delivered"
        elif self.calls == 1:
            raise KeyboardInterrupt
        self.writer._event.res = 8192  # what the kernel fills in
        self.writer._event.obj = 1
        if self.completed_first:
            raise KeyboardInterrupt
        return 1


@pytest.mark.parametrize("completed_first", [False, True])
def test_a_signal_during_wait_is_raised_only_after_the_write_completed(
    completed_first: bool,
) -> None:
    writer = DirectWriter(0, (-1, -1, -1, -1), native=False)  # fake syscall: no kernel
    writer._inflight = np.zeros(1, np.uint8)
    fake = _FakeSyscall(writer, completed_first)
    writer._syscall = fake  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        writer.wait()
    assert fake.calls == (1 if completed_first else 2)  # waited for the completion, once
    assert writer._inflight is None


def test_large_stores_through_aio_read_back_exact_and_survive_a_reopen(tmp_path: Any) -> None:
    path = str(tmp_path / "tier")
    sizes = (1 << 20, 700_000, 3 << 20, (600 << 10) + 5)  # whole and odd page counts
    tier = SsdTier(path, 16 << 20, make_policy("lru"))
    wanted: dict[bytes, np.ndarray] = {}
    try:
        for i, size in enumerate(sizes):
            rounded = -(-size // _PAGE) * _PAGE
            slot = aligned(rounded, 10 + i)  # an arena-like slot owning its extent
            key = bytes([i]) * 16
            assert tier.store(key, slot, size, None) is not None
            wanted[key] = slot[:size].copy()
        odd = aligned(2 << 20, 20)[1 : 1 + (1 << 20)]  # misaligned: the buffered path
        assert tier.store(b"u" * 16, odd, odd.nbytes, None) is not None
        wanted[b"u" * 16] = odd.copy()
    finally:
        tier.close()
    _assert_reopened(path, 16 << 20, wanted)


def test_without_native_aio_large_stores_are_written_synchronously(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aio_module.DirectWriter, "open", classmethod(lambda cls: None))
    tier = SsdTier(str(tmp_path / "tier"), 8 << 20, make_policy("lru"))
    try:
        slot = aligned(1 << 20, 5)
        record = tier.store(b"k" * 16, slot, slot.nbytes, None)
        assert record is not None
        out = aligned(1 << 20, 0)
        assert tier.read_into(record, out) and np.array_equal(out, slot)
    finally:
        tier.close()


class _LostWriter:
    """A writer whose kernel will not say whether the write finished."""

    def submit(self, fd: int, data: np.ndarray, offset: int) -> bool:
        return True

    def wait(self) -> int:
        raise AioLost("io_getevents failed: test")

    def close(self) -> None:
        pass


def test_a_lost_write_keeps_its_extent_used_and_commits_no_record(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write may still land: its extent must never be handed out again, and
    no record names it (so the block is simply not stored)."""
    monkeypatch.setattr(
        ssd_tier_module.DirectWriter, "open", classmethod(lambda cls: _LostWriter())
    )
    path = str(tmp_path / "tier")
    tier = SsdTier(path, 8 << 20, make_policy("lru"))
    try:
        slot = aligned(1 << 20, 6)
        with pytest.raises(StorageError, match="io_getevents"):
            tier.store(b"k" * 16, slot, slot.nbytes, None)
        assert tier.allocator.used_bytes == 1 << 20  # not freed
    finally:
        tier.close()
    tier = SsdTier(path, 8 << 20, make_policy("lru"))
    try:
        assert dict(tier.load_records()) == {}
    finally:
        tier.close()


# -- waiting for small writes awake (KVPOOL_SSD_SPIN_US) -----------------------------


def _spinning_writer(native: bool = False) -> DirectWriter:
    writer = _writer(native)
    if not writer.spins:
        writer.close()
        pytest.skip("this kernel's AIO ring is not one we can watch (or spinning is off)")
    return writer


@pytest.mark.parametrize("native", WAYS)
def test_a_small_write_is_waited_for_awake_and_a_large_one_asleep(
    tmp_path: Any, native: bool
) -> None:
    writer = _spinning_writer(native)
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 4 << 20)
    try:
        small = aligned(64 << 10, 30)
        assert writer.submit(direct, small, 0)
        assert writer.wait() == small.nbytes
        assert writer.spin_ready + writer.spin_timeouts == 1  # it spun, once
        assert os.pread(plain, small.nbytes, 0) == small.tobytes()
        large = aligned(aio_module.SPIN_MAX_BYTES + _PAGE, 31)
        assert writer.submit(direct, large, 1 << 20)
        assert writer.wait() == large.nbytes
        assert writer.spin_ready + writer.spin_timeouts == 1  # slept at once
        assert os.pread(plain, large.nbytes, 1 << 20) == large.tobytes()
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


@pytest.mark.parametrize("native", WAYS)
def test_a_spin_that_runs_out_of_budget_still_waits_for_the_write(
    tmp_path: Any, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _spinning_writer(native)
    monkeypatch.setattr(aio_module, "SPIN_US", 1)  # 1 us: the write nearly always outlasts it
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 4 << 20)
    try:
        for i in range(20):
            data = aligned(128 << 10, 40 + i)
            assert writer.submit(direct, data, i * data.nbytes)
            assert writer.wait() == data.nbytes  # io_getevents took over after the spin
            assert os.pread(plain, data.nbytes, i * data.nbytes) == data.tobytes()
        assert writer.spin_ready + writer.spin_timeouts == 20
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


def test_a_signal_while_spinning_is_raised_only_after_the_write_completed(
    tmp_path: Any,
) -> None:
    writer = _spinning_writer()
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)

    def interrupted() -> None:
        raise KeyboardInterrupt  # what a signal handler raises between two looks

    try:
        data = aligned(64 << 10, 50)
        assert writer.submit(direct, data, 0)
        writer._spin = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            writer.wait()
        assert writer._inflight is None  # the write completed before the raise
        assert os.pread(plain, data.nbytes, 0) == data.tobytes()
        del writer._spin
        assert writer.submit(direct, data, 0) and writer.wait() == data.nbytes  # usable
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


def test_only_a_ring_header_we_know_is_watched() -> None:
    import ctypes

    header = (ctypes.c_uint32 * 8)()
    at = ctypes.addressof(header)
    assert aio_module._ring_of(0) is None  # no context (a fake writer's)
    assert aio_module._ring_of(at) is None  # no magic
    header[1], header[4], header[7] = 127, 0xA10A10A1, 32  # slots, magic, header length
    assert aio_module._ring_of(at) is not None
    header[6] = 1  # a feature this reader does not understand
    assert aio_module._ring_of(at) is None
    header[6], header[7] = 0, 64  # a longer header: the events are not where we look
    assert aio_module._ring_of(at) is None
    header[7], header[1] = 32, 1  # one slot: taking its event leaves the head where it was
    assert aio_module._ring_of(at) is None


# -- completions taken from the ring (x86_64) ----------------------------------------


class _CountingSyscall:
    """The real syscall, counting the io_getevents calls."""

    def __init__(self, writer: DirectWriter) -> None:
        self.real, self.getevents = writer._syscall, 0
        self.number = writer._numbers[3]

    def __call__(self, number: Any, *args: Any) -> int:
        if number.value == self.number:
            self.getevents += 1
        return int(self.real(number, *args))


def _reaping_writer(monkeypatch: pytest.MonkeyPatch, native: bool = False) -> DirectWriter:
    """A writer that takes completions from the ring, spinning until one is posted
    (a 10 s budget: never a timeout, so which path reads the completion is certain)."""
    monkeypatch.setattr(aio_module, "SPIN_US", 10_000_000)
    writer = _spinning_writer(native)
    if writer._posted is None:
        writer.close()
        pytest.skip("completions are taken from the ring on x86_64 only")
    return writer


@pytest.mark.parametrize("native", WAYS)
def test_completions_are_taken_from_the_ring_round_and_round(
    tmp_path: Any, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More writes than the ring has slots, each read back exact, every completion
    taken without io_getevents: the head wrapped round the ring."""
    writer = _reaping_writer(monkeypatch, native)
    ring = writer._ring
    assert ring is not None
    slots = ring[1]
    counting = _CountingSyscall(writer)
    writer._syscall = counting  # type: ignore[assignment]
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    try:
        for i in range(slots + 9):
            data = aligned(_PAGE, 100 + i)
            at = (i % 256) * _PAGE
            assert writer.submit(direct, data, at)
            assert writer.wait() == _PAGE
            assert os.pread(plain, _PAGE, at) == data.tobytes()
            assert ring[2] == ring[3]  # consumed: nothing stays posted
        assert writer.spin_ready == slots + 9 and counting.getevents == 0  # round the ring
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


class _InterruptedArray:
    """The ring's event array as a signal would interrupt its read."""

    def __getitem__(self, index: int) -> Any:
        raise KeyboardInterrupt


def test_a_signal_while_taking_a_completion_leaves_it_to_io_getevents(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _reaping_writer(monkeypatch)
    ring = writer._ring
    assert ring is not None
    counting = _CountingSyscall(writer)
    writer._syscall = counting  # type: ignore[assignment]
    posted = writer._posted
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    try:
        data = aligned(64 << 10, 110)
        assert writer.submit(direct, data, 0)
        writer._posted = _InterruptedArray()  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            writer.wait()
        assert counting.getevents == 1 and ring[2] == ring[3]  # read there, once
        assert writer._inflight is None
        assert os.pread(plain, data.nbytes, 0) == data.tobytes()
        writer._posted = posted
        _writes_again(writer, direct, plain, 111)
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


def test_a_completion_that_is_not_ours_is_a_lost_write(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ring should only ever hold our one write's completion; anything else
    means we misread it, so the write's state is unknown (AioLost)."""
    writer = _reaping_writer(monkeypatch)
    posted = writer._posted
    assert posted is not None

    class Foreign:
        def __getitem__(self, index: int) -> Any:
            event = IoEvent()
            event.obj, event.res = 1, posted[index].res
            return event

    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    try:
        assert writer.submit(direct, aligned(64 << 10, 120), 0)
        writer._posted = Foreign()  # type: ignore[assignment]
        with pytest.raises(AioLost, match="not ours"):
            writer.wait()
        assert writer._inflight is None  # the real completion was still read
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


# -- the C submit / reap (kvpool.storage._aio_native) -------------------------------


def _native_module() -> Any:
    if aio_module._NATIVE is None:
        pytest.skip("kvpool.storage._aio_native is not built (or this is not x86_64)")
    return aio_module._NATIVE


class _Ring(ctypes.Structure):
    """A completion ring as the kernel lays it out: eight u32, then the events."""

    _fields_ = [("header", ctypes.c_uint32 * 8), ("events", IoEvent * 4)]


def test_the_writers_status_says_which_path_writes_take() -> None:
    assert ("in C" in aio_module.STATUS) == (aio_module._NATIVE is not None)
    writer = DirectWriter.open()
    if writer is not None:
        assert writer.native == (aio_module._NATIVE is not None)
        writer.close()


def test_the_native_reap_takes_only_our_posted_event_and_wraps_the_head() -> None:
    native = _native_module()
    ring, out = _Ring(), IoEvent()
    ring.header[1] = 4  # slots
    at, ours, out_at = ctypes.addressof(ring), 0x1234000, ctypes.addressof(out)
    assert native.reap(at, ours, out_at, 1000) == 0  # nothing posted: the budget ran out
    assert out.obj == 0 and ring.header[2] == 0
    ring.header[2], ring.header[3] = 3, 0  # one event posted in the last slot
    ring.events[3].obj, ring.events[3].res = 0x5678000, 4096
    assert native.reap(at, ours, out_at, 10**9) == -1  # not ours: left where it is
    assert out.obj == 0 and ring.header[2] == 3
    ring.events[3].obj = ours
    assert native.reap(at, ours, out_at, 10**9) == 1
    assert (out.obj, out.res, ring.header[2]) == (ours, 4096, 0)  # taken, head wrapped
    ring.header[2], ring.header[3] = 7, 0  # a head past the slots: a ring we misread
    assert native.reap(at, ours, out_at, 10**9) == -1 and ring.header[2] == 7


def test_the_native_submit_refuses_what_the_kernel_must_not_see(tmp_path: Any) -> None:
    """Another process's context, a scattered buffer, an empty one: refused before
    io_submit (0), nothing in flight; the writer then takes a good write."""
    writer = _writer(native=True)
    native = _native_module()
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    ctx, iocb = writer._ctx.value, writer._iocb_at
    try:
        good = aligned(_PAGE, 140)
        assert native.submit(ctx, iocb, direct, good, 0, os.getpid() + 1) == 0
        assert native.submit(ctx, iocb, direct, aligned(4 * _PAGE, 141)[::2], 0, os.getpid()) == 0
        assert native.submit(ctx, iocb, direct, aligned(_PAGE, 142)[:0], 0, os.getpid()) == 0
        assert not writer.submit(direct, aligned(_PAGE, 143)[:0], 0)
        assert writer._inflight is None
        assert writer.submit(direct, good, 0) and writer.wait() == _PAGE
        assert os.pread(plain, _PAGE, 0) == good.tobytes()
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


def test_a_native_writer_refuses_in_a_forked_child(tmp_path: Any) -> None:
    writer = _writer(native=True)
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    try:
        data = aligned(_PAGE, 150)
        pid = os.fork()
        if pid == 0:  # the child must not use its parent's context
            os._exit(0 if not writer.submit(direct, data, 0) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert writer.submit(direct, data, 0) and writer.wait() == _PAGE  # the parent's is fine
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


class _ReapThenInterrupt:
    """The C module, with a signal's exception landing right after ``reap`` took
    the completion (before its caller saw the return value)."""

    def __init__(self, real: Any) -> None:
        self.real, self.submit, self.reaps = real, real.submit, 0

    def reap(self, *args: Any) -> int:
        self.reaps += 1
        self.real.reap(*args)
        raise KeyboardInterrupt


def test_a_signal_after_the_native_reap_took_the_completion_reads_it_from_there(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _reaping_writer(monkeypatch, native=True)
    counting = _CountingSyscall(writer)
    writer._syscall = counting  # type: ignore[assignment]
    fast = _ReapThenInterrupt(writer._fast)
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    try:
        data = aligned(64 << 10, 160)
        assert writer.submit(direct, data, 0)
        writer._fast = fast  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            writer.wait()
        assert fast.reaps == 1 and counting.getevents == 0  # taken once, in C
        assert writer._inflight is None
        assert os.pread(plain, data.nbytes, 0) == data.tobytes()
        writer._fast = fast.real
        _writes_again(writer, direct, plain, 161)
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


@pytest.mark.parametrize(
    ("value", "spins", "error"),
    [
        ("0", False, ""),
        ("", True, ""),
        ("abc", False, "KVPOOL_SSD_SPIN_US"),
        ("-5", False, "KVPOOL_SSD_SPIN_US"),
    ],
)
def test_the_spin_budget_comes_from_the_environment(value: str, spins: bool, error: str) -> None:
    script = (
        "from kvpool.storage.direct_aio import DirectWriter\n"
        "w = DirectWriter.open()\n"
        "print('none' if w is None else w.spins)\n"
    )
    env = {**os.environ, "KVPOOL_SSD_SPIN_US": value}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    if error:
        assert done.returncode != 0 and error in done.stderr
        return
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "none":
        pytest.skip("native AIO is not available here")
    assert done.stdout.strip() == str(spins)


def test_small_tier_stores_overlap_the_write_when_it_is_waited_for_awake(tmp_path: Any) -> None:
    """With spinning, a 64 KiB store is queued through AIO (hashed and staged while
    it runs) and reads back exact, also after a reopen; ``write_wait`` says so."""
    _spinning_writer().close()
    path = str(tmp_path / "tier")
    tier = SsdTier(path, 8 << 20, make_policy("lru"))
    slots = [aligned(64 << 10, 60 + i) for i in range(8)]
    try:
        assert tier.write_wait()["aio"] is None  # nothing written yet
        for i, slot in enumerate(slots):
            assert tier.store(bytes([i]) * 16, slot, slot.nbytes, None) is not None
        wait = tier.write_wait()
        assert wait["aio"] is True and wait["spin_us"] == aio_module.SPIN_US
        # each waited for awake (it spun once), or synchronous after a spin ran out
        assert wait["spin_ready"] + wait["spin_timeouts"] == wait["awake_writes"] >= 1
        assert wait["awake_writes"] + wait["sync_writes"] == len(slots)
    finally:
        tier.close()
    _assert_reopened(path, 8 << 20, {bytes([i]) * 16: slot for i, slot in enumerate(slots)})


def test_without_spinning_small_stores_are_written_synchronously(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aio_module, "SPIN_US", 0)  # read at the writer's creation
    tier = SsdTier(str(tmp_path / "tier"), 8 << 20, make_policy("lru"))
    try:
        slot = aligned(64 << 10, 70)
        record = tier.store(b"s" * 16, slot, slot.nbytes, None)
        assert record is not None
        wait = tier.write_wait()
        assert wait["spin_us"] == 0 and wait["spin_ready"] + wait["spin_timeouts"] == 0
        out = aligned(64 << 10, 0)
        assert tier.read_into(record, out) and np.array_equal(out, slot)
    finally:
        tier.close()


@pytest.mark.parametrize("native", WAYS)
def test_submit_takes_writable_and_read_only_buffers_and_refuses_scattered_ones(
    tmp_path: Any, native: bool
) -> None:
    writer = _writer(native)
    plain, direct = _direct_file(str(tmp_path / "data.bin"), 1 << 20)
    try:
        data = aligned(2 * _PAGE, 130)
        read_only = data.view()
        read_only.flags.writeable = False
        for at, buffer in ((0, data), (4 * _PAGE, read_only)):
            assert writer.submit(direct, buffer, at) and writer.wait() == buffer.nbytes
            assert os.pread(plain, buffer.nbytes, at) == data.tobytes()
        assert not writer.submit(direct, aligned(4 * _PAGE, 131)[::2], 0)  # not one piece
        assert writer._inflight is None
    finally:
        writer.close()
        os.close(direct)
        os.close(plain)


def test_a_tier_whose_spins_run_out_writes_synchronously_and_reads_back_exact(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 us spin budget: a small store's spin soon runs out (a 64 KiB device
    write outlasts it, unless the hypervisor finished it inside ``io_submit``), and
    every small store after that goes synchronously (kvpool.storage.wait_choice);
    every block reads back exact, also after a reopen."""
    monkeypatch.setattr(aio_module, "SPIN_US", 1)
    path = str(tmp_path / "tier")
    tier = SsdTier(path, 8 << 20, make_policy("lru"))
    slots = [aligned(64 << 10, i) for i in range(32)]
    try:
        for i, slot in enumerate(slots):
            assert tier.store(i.to_bytes(16, "big"), slot, slot.nbytes, None) is not None
        wait = tier.write_wait()
        if not wait["spin_us"]:
            pytest.skip("small writes are not waited for awake here (no AIO ring)")
        if wait["spin_timeouts"] == 0:
            pytest.skip("the device finished every 64 KiB write within 1 us")
        # awake up to the first timeout, synchronous after it (fewer than BACKOFF_WRITES)
        assert wait["spin_timeouts"] == 1
        assert wait["awake_writes"] == wait["spin_ready"] + 1
        assert wait["sync_writes"] == len(slots) - wait["awake_writes"]
    finally:
        tier.close()
    _assert_reopened(path, 8 << 20, {i.to_bytes(16, "big"): slot for i, slot in enumerate(slots)})
