"""One O_DIRECT write in flight through Linux native AIO (io_submit / io_getevents).

Why: the SSD tier hashes a large block while its O_DIRECT write runs. Handing
the write to a thread cost ~100-150 us per block on the 2-vCPU VM this was
measured on (a Future, a queue, two cross-CPU wake-ups: issue #17), a fifth of
a 1 MiB write. ``io_submit`` queues the write in the kernel and returns, so the
caller hashes on its own thread while the device works, and only the
completion wait remains: the same wait a blocking ``pwrite`` has.

Scope: O_DIRECT descriptors only (a buffered AIO write runs synchronously inside
``io_submit``), little-endian Linux on x86_64 or aarch64 (the syscall numbers
and the ``iocb`` layout below). Elsewhere, or where the kernel refuses an AIO
context (seccomp, ``fs.aio-max-nr``), ``DirectWriter.open`` answers None and
callers write synchronously.

Invariant: ``wait`` returns or raises only once the write is no longer in
flight (the kernel reported its completion), so the caller may then reuse the
buffer and the file extent. The one exception is ``AioLost`` (the kernel
refused to report at all): the write's state is unknown and the caller must
never reuse that extent.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

import numpy as np

from kvpool.errors import StorageError

# (io_setup, io_destroy, io_submit, io_getevents)
_SYSCALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}
_IOCB_CMD_PWRITE = 1


class _Iocb(ctypes.Structure):
    """``struct iocb`` of <linux/aio_abi.h>, little-endian field order (64 bytes)."""

    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    """``struct io_event``: res is the byte count or a negative errno."""

    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class AioLost(StorageError):
    """The kernel would not report a submitted write's completion: it may still land."""


class DirectWriter:
    """An AIO context holding at most one write; not thread-safe (the SSD tier
    calls it under the pool's lock)."""

    def __init__(self, ctx: int, numbers: tuple[int, int, int, int]) -> None:
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._ctx = ctypes.c_ulong(ctx)
        self._numbers = numbers
        self._iocb = _Iocb()
        self._iocb.aio_lio_opcode = _IOCB_CMD_PWRITE
        self._iocbs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(self._iocb))
        self._event = _Event()
        self._event_ptr = ctypes.pointer(self._event)
        self._one = ctypes.c_long(1)
        self._inflight: np.ndarray | None = None  # keeps the buffer alive meanwhile
        self._pid = os.getpid()  # a context belongs to the process that made it

    @classmethod
    def open(cls) -> DirectWriter | None:
        """A fresh context, or None where native AIO is unavailable here."""
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or sys.byteorder != "little" or not sys.platform.startswith("linux"):
            return None
        try:
            syscall = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            return None
        syscall.restype = ctypes.c_long
        ctx = ctypes.c_ulong(0)
        if syscall(ctypes.c_long(numbers[0]), ctypes.c_long(1), ctypes.byref(ctx)) != 0:
            return None  # ENOSYS, EPERM (seccomp), EAGAIN (fs.aio-max-nr)
        return cls(ctx.value, numbers)

    def submit(self, fd: int, data: np.ndarray, offset: int) -> bool:
        """Start writing all of ``data`` at ``offset``; False (nothing in flight)
        if the kernel refused it at once (e.g. EINVAL for a misaligned buffer) or
        this context cannot take it: the caller then writes synchronously."""
        if self._inflight is not None or os.getpid() != self._pid:
            return False  # after AioLost, or a context inherited across fork
        iocb = self._iocb
        iocb.aio_fildes = fd
        iocb.aio_buf = data.__array_interface__["data"][0]
        iocb.aio_nbytes = data.nbytes
        iocb.aio_offset = offset
        if self._syscall(ctypes.c_long(self._numbers[2]), self._ctx, self._one, self._iocbs) != 1:
            return False
        self._inflight = data
        return True

    def wait(self) -> int:
        """Bytes the submitted write moved, once it completed; OSError if it failed.

        A signal's exception (KeyboardInterrupt) raised meanwhile is held back
        until the write completed, then raised.
        """
        held: BaseException | None = None
        number = ctypes.c_long(self._numbers[3])
        event = self._event
        event.obj = 0  # the kernel sets it (our iocb's address) with the completion
        while not event.obj:  # not ``got == 1``: an exception may land before that test
            try:
                got = self._syscall(number, self._ctx, self._one, self._one, self._event_ptr, None)
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

    def close(self) -> None:
        """Destroy the context (no write may be in flight). Idempotent."""
        if self._ctx.value and os.getpid() == self._pid:
            self._syscall(ctypes.c_long(self._numbers[1]), self._ctx)
        self._ctx = ctypes.c_ulong(0)
