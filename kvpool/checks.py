"""Argument checks shared by the embedded pool and the remote client.

Both raise before any state changes, with messages that say what to pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.bindings.buffers import Region, as_region, region_nbytes
from kvpool.errors import BufferSpecError, InvalidKeyError
from kvpool.index.keys import KEY_BYTES


def check_key(key: object, what: str = "key") -> None:
    if not isinstance(key, bytes):
        raise InvalidKeyError(
            f"{what} must be bytes of length {KEY_BYTES} (from kvpool.block_keys), "
            f"got {type(key).__name__}"
        )
    if len(key) != KEY_BYTES:
        raise InvalidKeyError(f"{what} must be exactly {KEY_BYTES} bytes, got {len(key)}")


def data_region(data: Any) -> Region:
    src = as_region(data, what="data")
    if region_nbytes(src) == 0:
        raise BufferSpecError("data is empty; a block must have at least one byte")
    return src


def check_keys(keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None) -> None:
    for key in keys:
        check_key(key)
    for parent in parents or ():
        if parent is not None:
            check_key(parent, what="parent")
