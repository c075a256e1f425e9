"""One O_DIRECT read in pieces through native AIO, each piece handed over as it lands.

Why: the SSD tier verifies every block it reads (an xxh3 checksum over its bytes).
Hashed after a whole-block read, the hash ran on bytes the device had just
written to memory by DMA, none of them in a cache: 0.7 ms of a 16 MiB read's 6.8
ms (0.86x a raw O_DIRECT read; 4 MiB 0.89x; issue 17). Here the read goes to the
kernel as up to ``MAX_PIECES`` requests submitted at once (the device sees as
much queued as for one large read: the kernel splits either into the same
requests), and the caller gets each piece, in order, once it and every piece
before it landed; it hashes piece k while the later ones still read, and only
the last piece's hash follows the device.

``PieceReader`` is one AIO context (not thread-safe); ``PieceReaders`` is the
tier's small stock of them, safe to share between threads (``SsdTier.read_into``
runs outside the pool's lock).

Invariant: ``PieceReader.read`` returns or raises only once no piece is in flight
(the kernel reported every submitted one, or the context was destroyed, which
waits for them), so the caller may reuse ``out`` and read it. Pieces are handed
over in order, each once, and only whole: a piece that failed or came back short
stops the hand-over, and ``read`` answers False (nothing may be concluded from
the pieces already handed over; the caller reads the block again its own way).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable

import numpy as np

from kvpool.errors import StorageError
from kvpool.storage.aio_abi import (
    IOCB_CMD_PREAD,
    Iocb,
    IoEvent,
    address_of,
    libc_syscall,
    open_context,
)

#: Reads from this size go in pieces (smaller ones: one synchronous read): as many of
#: at least ``PIECE_MIN`` as fit, but at least two and at most ``MAX_PIECES`` (1 and
#: 2 MiB in halves, 4 MiB in four, 16 MiB in eight). Measured on the Intel
#: VM's disk (issue 17, session 39; raw O_DIRECT ~1.4-1.7 GB/s), one tier read
#: against a raw read in the same process: a 1 MiB read's cold hash is ~100 us of
#: ~700, and halves read 0.85-0.95x against 0.83-0.88x whole; 4 MiB in four 0.91-0.95x
#: against 0.90-0.91x in halves; 16 MiB in eight 0.97x against 0.91x (an SSD hit,
#: hashed and copied on: 0.93 against 0.82-0.85). Pieces under 1 MiB past the halves
#: cost more than they hide (1 MiB in four: 0.82-0.84x; 2 MiB in four: 0.86-0.88x): each
#: landed piece is a wake-up of the reader.
PIECED_MIN = 1 << 20
#: The smallest piece (but for the halves of a read under 2 MiB), the most pieces.
PIECE_MIN = 1 << 20
MAX_PIECES = 8
#: AIO contexts per tier: concurrent pieced reads beyond this read synchronously.
MAX_READERS = 4
_ALIGN = 4096


def pieces_of(nbytes: int) -> list[tuple[int, int]]:
    """[lo, hi) of each piece of a read of ``nbytes`` (a multiple of 4096): as many
    as fit up to ``MAX_PIECES`` of at least ``PIECE_MIN``, and two from
    ``PIECED_MIN`` up, 4096-aligned, the last one possibly shorter."""
    count = min(MAX_PIECES, nbytes // PIECE_MIN)
    count = max(count, 2 if nbytes >= PIECED_MIN else 1)
    step = -(-nbytes // count)
    step = -(-step // _ALIGN) * _ALIGN
    return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]


class PieceReader:
    """An AIO context with ``MAX_PIECES`` slots, reading one range at a time."""

    def __init__(self, ctx: int, numbers: tuple[int, int, int, int]) -> None:
        syscall = libc_syscall()
        assert syscall is not None  # open() found it
        self._syscall = syscall
        self._ctx = ctypes.c_ulong(ctx)
        self._destroy, self._submit, self._getevents = (ctypes.c_long(n) for n in numbers[1:])
        self._iocbs = (Iocb * MAX_PIECES)()
        for iocb in self._iocbs:
            iocb.aio_lio_opcode = IOCB_CMD_PREAD
        pointers = ctypes.POINTER(Iocb) * MAX_PIECES
        self._pointers = pointers(*(ctypes.pointer(iocb) for iocb in self._iocbs))
        self._events = (IoEvent * MAX_PIECES)()
        self._pid = os.getpid()  # a context belongs to the process that made it
        self.broken = False  # the context was destroyed after a failed reap

    @classmethod
    def open(cls) -> PieceReader | None:
        """A fresh context, or None where native AIO is unavailable here."""
        context = open_context(MAX_PIECES)
        return None if context is None else cls(context.ctx, context.numbers)

    def read(self, fd: int, out: np.ndarray, offset: int, each: Callable[[int, int], None]) -> bool:
        """Read ``out.nbytes`` bytes at ``offset`` of ``fd`` (O_DIRECT: ``out``,
        ``offset`` and the length 4096-aligned) into ``out``; call ``each(lo, hi)``
        for every piece in order once it and all before it are whole. True when
        every piece landed whole; False when the kernel refused the read (EINVAL:
        misaligned), a piece came back short, or this context cannot read (broken,
        inherited across fork): the caller then reads the range another way.
        OSError for a device error; an exception ``each`` raised stops the
        hand-over and is raised once nothing is in flight."""
        address = address_of(out)
        if self.broken or os.getpid() != self._pid or address is None:
            return False
        pieces = pieces_of(out.nbytes)
        for i, (lo, hi) in enumerate(pieces):
            iocb = self._iocbs[i]
            iocb.aio_data = i
            iocb.aio_fildes = fd
            iocb.aio_buf = address + lo
            iocb.aio_nbytes = hi - lo
            iocb.aio_offset = offset + lo
        events = self._events
        for event in events:  # none left from an earlier read
            event.obj = 0
        submitted, refused = self._submit_all(len(pieces))
        landed: list[bool | None] = [None] * submitted  # None: in flight
        failure: int | None = None  # errno of the first piece that failed (0: short)
        handed, held = 0, None
        while True:
            # Signal-safe: a completion the kernel wrote into ``events`` stays there
            # (``obj`` nonzero) until the next wait, so whatever interrupts this loop,
            # the next pass counts it (counting is idempotent); nothing is waited
            # for twice and no completion is lost.
            try:
                for event in events:
                    if event.obj:
                        i = event.data
                        if landed[i] is None:
                            lo, hi = pieces[i]
                            landed[i] = event.res == hi - lo
                            if not landed[i] and failure is None:
                                failure = -event.res if event.res < 0 else 0
                while failure is None and held is None and handed < submitted and landed[handed]:
                    lo, hi = pieces[handed]
                    handed += 1
                    each(lo, hi)
                in_flight = landed.count(None)
                if not in_flight:
                    break
                for event in events:
                    event.obj = 0
                self._reap(in_flight)
            except StorageError:
                raise  # the context is destroyed: nothing in flight
            except BaseException as exc:  # a signal handler's, or each's own
                held = held or exc
        if held is not None:
            raise held
        if failure not in (None, 0, errno.EINVAL):
            raise OSError(failure, os.strerror(failure))
        return not refused and failure is None and handed == len(pieces)

    def _submit_all(self, count: int) -> tuple[int, bool]:
        """Queue the first ``count`` iocbs: how many the kernel took, and whether
        it refused the rest (EINVAL for a misaligned range, EAGAIN ...)."""
        submitted = 0
        step = ctypes.sizeof(ctypes.c_void_p)
        while submitted < count:
            took = self._syscall(
                self._submit,
                self._ctx,
                ctypes.c_long(count - submitted),
                ctypes.byref(self._pointers, submitted * step),
            )
            if took <= 0:
                return submitted, True
            submitted += took
        return submitted, False

    def _reap(self, in_flight: int) -> None:
        """Wait until at least one of ``in_flight`` completions is in ``_events``
        (or a signal interrupted the wait). Were the kernel to refuse to report
        at all, the context is destroyed (which waits for the reads in flight)
        and StorageError raised: ``out`` is then safe to reuse."""
        one, most = ctypes.c_long(1), ctypes.c_long(in_flight)
        got = self._syscall(self._getevents, self._ctx, one, most, self._events, None)
        if got >= 0 or ctypes.get_errno() == errno.EINTR:
            return
        err = ctypes.get_errno()
        self.close()  # marks it broken: never lent again
        raise StorageError(f"io_getevents failed: {os.strerror(err)}")

    def close(self) -> None:
        """Destroy the context (it waits for anything in flight). Idempotent."""
        if self._ctx.value and os.getpid() == self._pid:
            self._syscall(self._destroy, self._ctx)
        self._ctx = ctypes.c_ulong(0)
        self.broken = True


class PieceReaders:
    """Up to ``MAX_READERS`` readers, each lent to one read at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[PieceReader] = []
        self._opened = 0
        self._unavailable = False  # the kernel gave no context: read synchronously
        self._closed = False

    def read(self, fd: int, out: np.ndarray, offset: int, each: Callable[[int, int], None]) -> bool:
        """``PieceReader.read`` on an idle reader; False (nothing read) when none
        is idle and no more may be opened, or native AIO is unavailable."""
        reader = self._borrow()
        if reader is None:
            return False
        try:
            return reader.read(fd, out, offset, each)
        finally:
            self._give_back(reader)

    def _borrow(self) -> PieceReader | None:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._unavailable or self._closed or self._opened >= MAX_READERS:
                return None
            self._opened += 1
        reader = PieceReader.open()
        if reader is None:
            with self._lock:
                self._unavailable = True
                self._opened -= 1
        return reader

    def _give_back(self, reader: PieceReader) -> None:
        with self._lock:
            if not reader.broken and not self._closed:
                self._idle.append(reader)
                return
            self._opened -= 1
        reader.close()

    def close(self) -> None:
        """Destroy the idle contexts; those lent out are destroyed when returned."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._opened -= len(idle)
        for reader in idle:
            reader.close()
