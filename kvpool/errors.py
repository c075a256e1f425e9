"""Every error kvpool raises derives from KVPoolError.

Each also derives from the closest built-in, so callers that catch
ValueError or OSError keep working.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base class of every kvpool error."""


class InvalidKeyError(KVPoolError, ValueError):
    """A key is not ``bytes`` of exactly 16 bytes."""


class BufferSpecError(KVPoolError, ValueError):
    """A data or output buffer is unusable: not contiguous, wrong size, read-only."""


class BlockTooLargeError(KVPoolError, ValueError):
    """A value is larger than the tier (or every tier) it could live in."""


class PoolFullError(KVPoolError):
    """No room even after evicting everything evictable (the rest is pinned by readers)."""


class PoolClosedError(KVPoolError, RuntimeError):
    """The pool was used after ``close()``."""


class StorageError(KVPoolError, OSError):
    """The SSD tier cannot be used: path not writable, disk full, I/O error."""


class TierUnavailableError(KVPoolError, RuntimeError):
    """A tier was asked for where its hardware is absent (GPU tier without CUDA)."""
