"""kvpool: a distributed KV-cache store for LLM serving.

Public names: ``Pool``, ``Namespace``, ``KVLayout``, ``block_keys`` and the
errors in ``kvpool.errors``.
"""

__version__ = "0.1.0"

from kvpool.cluster.client.remote_pool import RemotePool, connect
from kvpool.embedded.pool import Pool
from kvpool.errors import (
    BlockTooLargeError,
    BufferSpecError,
    CallTimeoutError,
    ConnectionLostError,
    HandshakeRefusedError,
    InvalidKeyError,
    KVPoolError,
    PoolClosedError,
    PoolFullError,
    PutCommitError,
    PutFailedError,
    StorageError,
    TierUnavailableError,
)
from kvpool.index.keys import Namespace, block_keys
from kvpool.layout import KVLayout

__all__ = [
    "BlockTooLargeError",
    "BufferSpecError",
    "CallTimeoutError",
    "ConnectionLostError",
    "HandshakeRefusedError",
    "InvalidKeyError",
    "KVLayout",
    "KVPoolError",
    "Namespace",
    "Pool",
    "PoolClosedError",
    "PoolFullError",
    "PutCommitError",
    "PutFailedError",
    "RemotePool",
    "StorageError",
    "TierUnavailableError",
    "__version__",
    "block_keys",
    "connect",
]
