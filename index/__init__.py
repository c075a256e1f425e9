"""Chained block hashing and the block catalog (installed as ``kvpool.index``)."""

from kvpool.index.keys import (
    DEFAULT_BLOCK_TOKENS,
    KEY_BYTES,
    BlockKey,
    Namespace,
    block_keys,
    root_key,
    token_array,
)

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "KEY_BYTES",
    "BlockKey",
    "Namespace",
    "block_keys",
    "root_key",
    "token_array",
]
