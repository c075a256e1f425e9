"""A small /dev/shm file beside a node's arena, mapped as u64 words.

The same-host identity records (kvpool.transport.shm_ident) and seal records
(kvpool.transport.shm_seal) each live in one. Invariants: the node creates
the file (``create=True``, exclusive: a stale file from a crashed node of the
same arena name is an error, not silently shared) and is the only one that
unlinks it, at ``close``; a client maps an existing file only if its size is
the one the arena implies, so a file of another arena is refused.
"""

from __future__ import annotations

import contextlib
import mmap
import os


class SideFile:
    """``path`` mapped (read-only unless ``writable`` or ``create``), as ``_words``."""

    def __init__(self, path: str, size: int, *, create: bool, writable: bool, what: str) -> None:
        self.path = path
        self._owner = create
        if create:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        else:
            flags = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"{path} is not {what}")
            access = mmap.ACCESS_WRITE if create or writable else mmap.ACCESS_READ
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)
        # u64 words: one aligned 8-byte load or store per access, and a plain int
        # back (cheaper than numpy scalars).
        self._words: memoryview | None = memoryview(self._mmap).cast("Q")

    @property
    def mapping(self) -> mmap.mmap | None:
        """The file's mapping, for native code that reads or writes its records
        (kvpool.transport.shm_copy); None once closed."""
        return self._mmap

    def close(self) -> None:
        """Unmap (a view still exported keeps the mapping until it is released);
        the creator also unlinks the file."""
        if self._mmap is not None:
            if self._words is not None:
                self._words.release()
                self._words = None
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if self._owner:
            self._owner = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
