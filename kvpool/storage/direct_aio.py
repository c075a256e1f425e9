"""One O_DIRECT write in flight through Linux native AIO (io_submit / io_getevents).

Why: the SSD tier hashes a large block while its O_DIRECT write runs. Handing
the write to a thread cost ~100-150 us per block on the 2-vCPU VM this was
measured on (a Future, a queue, two cross-CPU wake-ups: issue #17), a fifth of
a 1 MiB write. ``io_submit`` queues the write in the kernel and returns, so the
caller hashes on its own thread while the device works, and only the
completion wait remains: the same wait a blocking ``pwrite`` has.

Scope: O_DIRECT descriptors only (a buffered AIO write runs synchronously inside
``io_submit``), little-endian Linux on x86_64 or aarch64 (the syscall numbers and
the ``iocb`` layout of kvpool.storage.aio_abi). Elsewhere, or where the kernel
refuses an AIO context (seccomp, ``fs.aio-max-nr``), ``DirectWriter.open``
answers None and callers write synchronously.

Waiting awake: where the write is small enough to finish within
``SPIN_US`` (``KVPOOL_SSD_SPIN_US``, default 200; 0 turns it off), ``wait``
first watches the completion ring the kernel maps into the process (its tail
moves when an event is posted), yielding the CPU between looks, and only then
calls ``io_getevents``, which returns at once if the write is done. Why: on VMs
whose idle loop halts the vCPU as soon as a thread sleeps (cpuidle haltpoll with
``guest_halt_poll_ns`` = 0), a sleep through a 64 KiB write costs a VM exit,
and the Python after it runs with cold caches: a 64 KiB tier put was 0.81-0.84x
a raw O_DIRECT ``pwrite``, against 0.88-1.00x spinning (bench/RESULTS.md,
"Session 12"). What it costs: up to ``SPIN_US`` of CPU per write of at most
``SPIN_MAX_BYTES`` (larger writes outlast any sensible budget and sleep at
once). When the look shows the completion posted, on x86_64 it is also taken
from the ring right there (the event read, the ring's head advanced, as the
kernel's own ``io_getevents`` does), which saves that call (~1-2 us of a
~100 us 64 KiB write here, issue 17). Elsewhere, and whenever the spin ran
out, ``io_getevents`` reads the completion; why x86_64 only: its loads are not
reordered with each other, so the event read after the tail was seen is the
one the kernel wrote before moving the tail, where a weaker memory order would
need a barrier Python cannot issue.

Where the optional extension ``kvpool.storage._aio_native`` is built (x86_64), the
submission (the iocb's fields, the buffer's address, the fork check, io_submit) and
the awake wait with its taking of the completion run there, in one C call each,
the GIL released: 3-5 us less Python around a ~80 us 64 KiB write (its header
says why). The ctypes path below stays for a build without a compiler, and
takes over the same context at any time (both fill the same ``Iocb`` and
``IoEvent``).

Invariant: ``wait`` returns or raises only once the write is no longer in
flight (the kernel reported its completion), so the caller may then reuse the
buffer and the file extent. The one exception is ``AioLost`` (the kernel
refused to report at all): the write's state is unknown and the caller must
never reuse that extent.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import os
import platform
import time
from types import ModuleType

import numpy as np

from kvpool.config import env_int
from kvpool.errors import StorageError
from kvpool.storage.aio_abi import (
    IOCB_CMD_PWRITE,
    Iocb,
    IoEvent,
    address_of,
    libc_syscall,
    open_context,
)

_AIO_RING_MAGIC = 0xA10A10A1  # struct aio_ring of fs/aio.c: id, nr, head, tail, magic,
# compat, incompat features, header length (u32 fields), then the io_event array
_RING_NR, _RING_HEAD, _RING_TAIL, _RING_MAGIC, _RING_INCOMPAT, _RING_HEADER_LEN = 1, 2, 3, 4, 6, 7
_RING_HEADER_BYTES = 32
#: Where completions may be taken from the ring without a barrier (see the docstring).
_MACHINE = platform.machine()
_USER_REAP = _MACHINE == "x86_64"

DEFAULT_SPIN_US = 200
SPIN_US = env_int("KVPOOL_SSD_SPIN_US", DEFAULT_SPIN_US, 1_000_000)
#: Writes up to this size are waited for awake: on these VMs' disks a 256 KiB
#: O_DIRECT write takes ~100-150 us, within the default budget; a MiB takes ~300.
SPIN_MAX_BYTES = 256 << 10


def _native() -> tuple[ModuleType | None, str]:
    """The compiled submit / reap (None where it was not built or may not reap), and
    which path writes take, in words (for ``kvpool bench``'s machine facts)."""
    if not _USER_REAP:
        return None, f"ctypes (completions are taken from the ring on x86_64, not {_MACHINE})"
    try:  # by name: the compiled module, not a Python one
        module = importlib.import_module("kvpool.storage._aio_native")
    except ImportError as exc:  # built without a compiler: the optional extension is absent
        return None, f"ctypes (kvpool.storage._aio_native not built: {exc})"
    return module, "submitted and reaped in C"


_NATIVE, STATUS = _native()


class AioLost(StorageError):
    """The kernel would not report a submitted write's completion: it may still land."""


class DirectWriter:
    """An AIO context holding at most one write; not thread-safe (the SSD tier
    calls it under the pool's lock)."""

    def __init__(self, ctx: int, numbers: tuple[int, int, int, int], native: bool = True) -> None:
        syscall = libc_syscall()
        assert syscall is not None  # open() found it
        self._syscall = syscall
        self._ctx = ctypes.c_ulong(ctx)
        self._numbers = numbers
        self._iocb = Iocb()
        self._iocb.aio_lio_opcode = IOCB_CMD_PWRITE
        self._iocbs = (ctypes.POINTER(Iocb) * 1)(ctypes.pointer(self._iocb))
        self._iocb_at = ctypes.addressof(self._iocb)  # what a completion's ``obj`` echoes
        self._submit, self._getevents = ctypes.c_long(numbers[2]), ctypes.c_long(numbers[3])
        self._event = IoEvent()
        self._event_ptr = ctypes.pointer(self._event)
        self._one = ctypes.c_long(1)
        self._inflight: np.ndarray | None = None  # keeps the buffer alive meanwhile
        self._pid = os.getpid()  # a context belongs to the process that made it
        self._ring = _ring_of(ctx) if SPIN_US else None
        self._posted = (  # the ring's io_event array, where completions are taken from
            (IoEvent * self._ring[_RING_NR]).from_address(ctx + _RING_HEADER_BYTES)
            if self._ring is not None and _USER_REAP
            else None
        )
        #: submit and reap in C (``native`` False: through ctypes, as without the build)
        self._fast = _NATIVE if native else None
        self._event_at = ctypes.addressof(self._event)
        self._spin_this = False  # the write in flight is waited for awake
        self.spin_ready = 0  # spins that saw the completion posted
        self.spin_timeouts = 0  # spins that ran out of budget (then io_getevents slept)

    @property
    def spins(self) -> bool:
        """Whether writes of up to ``SPIN_MAX_BYTES`` are waited for awake here."""
        return self._ring is not None

    @property
    def native(self) -> bool:
        """Whether writes are submitted and reaped in C (``kvpool.storage._aio_native``)."""
        return self._fast is not None

    @classmethod
    def open(cls, native: bool = True) -> DirectWriter | None:
        """A fresh context, or None where native AIO is unavailable here; ``native``
        False keeps the ctypes path even where the C one is built."""
        context = open_context(1)
        return None if context is None else cls(context.ctx, context.numbers, native)

    def submit(self, fd: int, data: np.ndarray, offset: int) -> bool:
        """Start writing all of ``data`` at ``offset``; False (nothing in flight)
        if the kernel refused it at once (e.g. EINVAL for a misaligned buffer) or
        this context cannot take it: the caller then writes synchronously."""
        if self._inflight is not None:
            return False  # after AioLost
        if self._fast is not None:
            queued = self._fast.submit(self._ctx.value, self._iocb_at, fd, data, offset, self._pid)
        else:
            queued = self._submit_ctypes(fd, data, offset)
        if queued != 1:
            return False
        self._inflight = data
        self._spin_this = self._ring is not None and data.nbytes <= SPIN_MAX_BYTES
        return True

    def _submit_ctypes(self, fd: int, data: np.ndarray, offset: int) -> int:
        """``submit``'s steps through ctypes: 1 queued, else refused (what the C one
        answers)."""
        if os.getpid() != self._pid:
            return 0  # a context inherited across fork
        address = address_of(data)
        if address is None:
            return 0
        iocb = self._iocb
        iocb.aio_fildes = fd
        iocb.aio_buf = address
        iocb.aio_nbytes = data.nbytes
        iocb.aio_offset = offset
        return int(self._syscall(self._submit, self._ctx, self._one, self._iocbs))

    def wait(self) -> int:
        """Bytes the submitted write moved, once it completed; OSError if it failed.

        A signal's exception (KeyboardInterrupt) raised meanwhile is held back
        until the write completed, then raised.
        """
        held: BaseException | None = None
        event = self._event
        event.obj = 0  # set (to our iocb's address) once the completion is read
        if self._spin_this:
            try:
                if self._fast is not None:
                    self._reap_native()
                elif self._spin() and self._posted is not None:
                    self._take_posted()
            except BaseException as exc:  # a signal handler's, while spinning
                held = exc
        while not event.obj:  # not ``got == 1``: an exception may land before that test
            try:
                got = self._syscall(
                    self._getevents, self._ctx, self._one, self._one, self._event_ptr, None
                )
                if got < 0 and ctypes.get_errno() != errno.EINTR:
                    raise AioLost(f"io_getevents failed: {os.strerror(ctypes.get_errno())}")
            except AioLost:
                raise
            except BaseException as exc:  # raised by a signal handler between calls
                held = exc
        self._inflight = None
        if held is not None:
            raise held
        res = event.res
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        return int(res)

    def _reap_native(self) -> None:
        """The awake wait in C: ``_spin`` and ``_take_posted`` in one call; the
        event, once taken, is in ``_event`` whatever is raised after the call."""
        assert self._fast is not None
        taken = self._fast.reap(self._ctx.value, self._iocb_at, self._event_at, SPIN_US * 1000)
        if taken == 0:
            self.spin_timeouts += 1
            return
        self.spin_ready += 1
        if taken < 0:  # io_getevents reads it; the write's state is unknown all the same
            raise AioLost("the AIO ring holds a completion not ours")

    def _spin(self) -> bool:
        """Until the ring shows a posted completion (True) or ``SPIN_US`` passed
        (False); the CPU yielded (and the GIL released, in ``os.sched_yield``)
        between looks."""
        ring, clock, yield_cpu = self._ring, time.perf_counter, os.sched_yield
        assert ring is not None
        end = clock() + SPIN_US / 1e6
        while ring[_RING_HEAD] == ring[_RING_TAIL]:
            if clock() > end:
                self.spin_timeouts += 1
                return False
            yield_cpu()
        self.spin_ready += 1
        return True

    def _take_posted(self) -> None:
        """Copy the completion at the ring's head into ``_event`` and consume it.

        Only our one write can be in flight, so the posted event is its own
        (checked: the kernel echoes our iocb's address). The head moves in one
        store after the copy: were a signal's exception raised before that store,
        ``_event.obj`` is cleared again and ``io_getevents`` reads the event.
        """
        ring, posted = self._ring, self._posted
        assert ring is not None and posted is not None
        head = ring[_RING_HEAD]
        event = self._event
        try:
            taken = posted[head]
            obj = taken.obj
            if obj != self._iocb_at:
                raise AioLost(f"the AIO ring holds a completion not ours: {obj:#x}")
            event.res = taken.res
            event.obj = obj
            ring[_RING_HEAD] = (head + 1) % ring[_RING_NR]
        finally:
            if ring[_RING_HEAD] == head:  # not consumed: io_getevents will read it
                event.obj = 0

    def close(self) -> None:
        """Destroy the context (no write may be in flight). Idempotent."""
        self._ring = None  # the ring is unmapped with the context
        if self._ctx.value and os.getpid() == self._pid:
            self._syscall(ctypes.c_long(self._numbers[1]), self._ctx)
        self._ctx = ctypes.c_ulong(0)


def _ring_of(ctx: int) -> ctypes.Array[ctypes.c_uint32] | None:
    """The header of the completion ring at address ``ctx`` (what ``io_setup``
    returns is that address), or None where it is not the layout we know (no
    context, another magic, incompatible features, another header length, under
    two slots): then ``wait`` only sleeps."""
    if not ctx:
        return None
    header = (ctypes.c_uint32 * 8).from_address(ctx)
    if (
        header[_RING_MAGIC] != _AIO_RING_MAGIC
        or header[_RING_INCOMPAT] != 0
        or header[_RING_HEADER_LEN] != _RING_HEADER_BYTES
        or header[_RING_NR] < 2  # one slot: a consumed head would look unmoved
    ):
        return None
    return header
