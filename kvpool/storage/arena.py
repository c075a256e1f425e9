"""One large shared-memory arena per node: the DRAM tier's backing store.

The arena is a file in /dev/shm mapped read-write, so other processes on the
host can map the same bytes by name (the same-host transport does exactly
that). It is reserved with posix_fallocate (no SIGBUS later when /dev/shm
fills up), pre-faulted at creation (first touch costs ~0.45 GB/s here, so
nobody should pay it on a put), and registered as page-locked with CUDA where
CUDA is present so device copies DMA straight from it (``page_lock`` holds the
outcome, reported by ``stats()``; see ``kvpool.storage.page_lock``).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets

import numpy as np

from kvpool.errors import PoolFullError, StorageError
from kvpool.storage.page_lock import PageLock
from kvpool.storage.page_lock import page_lock as register_page_lock

SHM_DIR = "/dev/shm"
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; absent from Python 3.11's mmap module


class SharedArena:
    """A named, pre-faulted shared-memory region of ``size`` bytes.

    ``view`` is a flat uint8 numpy array over the whole arena; slices of it
    are the zero-copy regions tiers read and write.
    """

    def __init__(
        self, size: int, name: str | None = None, *, create: bool = True, page_lock: bool = True
    ) -> None:
        if size <= 0:
            raise ValueError(f"arena size must be > 0, got {size}")
        self.size = size
        self.name = name or f"kvpool-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.owner = create
        fd = self._open(create)
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if create:
            _prefault(self._mmap, size)
        self.view: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self.page_lock: PageLock = register_page_lock(
            self.view.ctypes.data, size, enabled=page_lock
        )

    @classmethod
    def attach(cls, name: str, size: int) -> SharedArena:
        """Map an arena another process created (never unlinks it)."""
        return cls(size, name, create=False)

    def close(self) -> None:
        """Unmap, and unlink if this process created the arena. Idempotent."""
        if self._mmap is None:
            return
        self.page_lock.release()
        self.view = np.empty(0, dtype=np.uint8)
        # A caller may still hold a view (BufferError): the mapping then lives
        # until that view is dropped, but the name is released all the same.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None  # type: ignore[assignment]
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- helpers ----------------------------------------------------------

    def _open(self, create: bool) -> int:
        if not create:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                raise StorageError(f"no shared-memory arena named {self.name!r}") from None
            if os.fstat(fd).st_size < self.size:
                os.close(fd)
                raise StorageError(f"arena {self.name!r} is smaller than {self.size} bytes")
            return fd
        sweep_stale_arenas()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.path)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                free = _shm_free_bytes()
                raise PoolFullError(
                    f"cannot reserve {self.size} bytes of shared memory in {SHM_DIR} "
                    f"({free} bytes free); lower dram_bytes or enlarge {SHM_DIR}"
                ) from exc
            raise StorageError(f"cannot create arena {self.path}: {exc}") from exc
        return fd

    @property
    def page_locked(self) -> bool:
        return self.page_lock.registered


def sweep_stale_arenas() -> list[str]:
    """Unlink arenas left in /dev/shm by processes that died (kill -9, OOM).

    Arena names carry the creator's pid; a name whose pid is gone belongs to
    nobody. Mappings other processes still hold stay valid after unlinking.
    """
    removed = []
    for name in os.listdir(SHM_DIR):
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "kvpool" or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prefault(region: mmap.mmap, size: int) -> None:
    # Huge pages where shared memory may use them (shmem_enabled=advise): fewer TLB
    # misses on big copies. A no-op (or refused) elsewhere.
    with contextlib.suppress(OSError, AttributeError):
        region.madvise(mmap.MADV_HUGEPAGE)
    try:
        region.madvise(_MADV_POPULATE_WRITE, 0, size)
    except OSError:
        # Older kernels: touch one byte per page instead.
        np.frombuffer(region, dtype=np.uint8)[:: mmap.PAGESIZE] = 0


def _shm_free_bytes() -> int:
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize
