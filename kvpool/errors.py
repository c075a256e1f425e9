"""Every error kvpool raises derives from KVPoolError.

Each also derives from the closest built-in, so callers that catch
ValueError or OSError keep working.
"""

from __future__ import annotations

from collections.abc import Sequence


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


# --- RPC and transports (control plane and data path) ---------------------


class ConnectionLostError(KVPoolError, ConnectionError):
    """A peer (master or node) is unreachable, closed the connection, or died mid-call."""


class HandshakeRefusedError(KVPoolError, ConnectionRefusedError):
    """The server refused the handshake (wrong protocol version, missing or wrong token)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"handshake refused: {reason}")
        self.reason = reason


class CallTimeoutError(KVPoolError, TimeoutError):
    """A remote call or transfer did not complete within its timeout."""


class ProtocolError(KVPoolError, ValueError):
    """A frame or message violates the wire protocol (bad magic, version, shape)."""


class FrameTooLargeError(ProtocolError):
    """A frame's declared length exceeds the receiver's maximum frame size."""


class RemoteError(KVPoolError, RuntimeError):
    """A remote handler failed; ``code`` names the failure, ``remote_type`` its class."""

    def __init__(self, code: str, message: str, remote_type: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" ({remote_type})" if remote_type else ""))
        self.code = code
        self.remote_type = remote_type


class InsecureBindError(KVPoolError, ValueError):
    """A server was asked to bind beyond loopback without a shared token."""


class TransportUnavailableError(KVPoolError, RuntimeError):
    """A transport was requested that cannot reach this peer from here (or is not installed)."""


# --- master terms and failover (kvpool.cluster.link, node fencing) -------


class NotLeaderError(KVPoolError):
    """This master is a standby (or stopped leading): ask the leader. The message is
    the leader's ``host:port`` when known, else empty."""


class MasterNotReadyError(KVPoolError):
    """The master just took over and is waiting for nodes to re-register: retry soon."""


class StaleEpochError(KVPoolError):
    """A message from an older master term (a deposed or restarted master) was refused."""


class StaleWriteError(KVPoolError):
    """A node refused a write: its allocation is stale (a newer allocation or master
    term owns the range) or the range is still busy; the put is retried elsewhere."""


class MasterUnavailableError(KVPoolError, ConnectionError):
    """No master answered within the failover deadline (every address was tried)."""


class PermissionDeniedError(KVPoolError, PermissionError):
    """The caller may not call this method (e.g. a client calling a node-only one)."""


class StaleReadError(KVPoolError):
    """A node no longer holds the block a read named at that range (the reader's
    lease is from an older placement): the read tries another replica or misses."""


def _keys_text(keys: Sequence[bytes]) -> str:
    shown = ", ".join(k.hex()[:16] for k in keys[:4])
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return f"keys {shown}{more}"


class PutCommitError(KVPoolError):
    """Puts were acknowledged, but their blocks could not be made visible (their
    commit was refused and the bytes could not be recovered from the node)."""

    def __init__(self, keys: Sequence[bytes], why: str) -> None:
        self.keys = list(keys)
        super().__init__(
            f"{len(self.keys)} acknowledged put(s) could not be made visible "
            f"({_keys_text(self.keys)}): {why}"
        )


class PutFailedError(KVPoolError):
    """Puts could not store their blocks, retried on fresh allocations until the
    failover deadline: the nodes failed or refused the writes (a node died, or
    the cluster kept changing master terms). Nothing was acknowledged and nothing
    is visible for these keys: the put may simply be retried."""

    def __init__(self, keys: Sequence[bytes], why: str) -> None:
        self.keys = list(keys)
        super().__init__(
            f"{len(self.keys)} put(s) not stored after retries on fresh allocations "
            f"({_keys_text(self.keys)}) within {why}"
        )
