"""Blocking moves of a block's bytes through the SSD tier's descriptors.

``try_direct`` goes through the O_DIRECT descriptor and reports a buffer the
kernel refuses (EINVAL: misaligned) instead of raising, so the caller can take
the buffered descriptor; ``pwrite_full`` / ``pread_full`` continue a short
transfer until every byte moved; ``finish_direct`` waits for a write queued
through native AIO (``kvpool.storage.direct_aio``) and finishes a short one.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import numpy as np

from kvpool.errors import StorageError
from kvpool.storage.direct_aio import AioLost, DirectWriter


def try_direct(
    move: Callable[[int, np.ndarray, int], None], fd: int, data: np.ndarray, offset: int
) -> bool:
    """Move the bytes through the O_DIRECT descriptor; False (nothing moved) if the
    kernel refuses the buffer's alignment with EINVAL. Asking the kernel costs
    nothing on an aligned buffer (the common case: arena slots), where checking
    the address first would cost ~0.6 us a call (ctypes, as ``DirectWriter.submit``
    does because it needs the address anyway)."""
    try:
        move(fd, data, offset)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def finish_direct(aio: DirectWriter, fd: int, data: np.ndarray, offset: int) -> bool:
    """Wait for a submitted O_DIRECT write; a short one is finished synchronously.
    False (the bytes must go through the buffered descriptor) on EINVAL."""
    try:
        written = aio.wait()
    except OSError as exc:
        if isinstance(exc, AioLost) or exc.errno != errno.EINVAL:
            raise
        return False
    if written < data.nbytes:  # not seen on a preallocated file; rewrite it all
        return try_direct(pwrite_full, fd, data, offset)
    return True


def pwrite_full(fd: int, data: np.ndarray, offset: int) -> None:
    # one call in practice, straight from the array: no memoryview for the common case
    written = os.pwrite(fd, data, offset)  # type: ignore[arg-type]  # numpy exports a buffer
    if written == data.nbytes:
        return
    view = data.data.cast("B")[written:]
    offset += written
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def pread_full(fd: int, out: np.ndarray, offset: int) -> None:
    view = out.data.cast("B")
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise StorageError(f"unexpected end of SSD data file at offset {offset}")
        view, offset = view[got:], offset + got
