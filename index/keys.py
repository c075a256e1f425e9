"""Chained block keys: equal key <=> equal namespace and equal whole prefix.

A prompt is cut into full blocks of ``block_tokens`` tokens (the partial tail
gets no key). Block i's key is ``xxh3_128(parent ‖ namespace_digest ‖ tokens_i)``
where the tokens are little-endian int32, ``parent`` is block i-1's key and the
first block's parent is a root derived from the namespace and the block size.
Every byte that feeds the hash is fixed here, so keys are identical in every
process and on every machine; tests pin golden values so the format never
drifts silently.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvpool.layout import KVLayout

KEY_BYTES = 16
DEFAULT_BLOCK_TOKENS = 512
_FORMAT_TAG = b"kvpool/key/v1\x00"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

BlockKey = bytes  # always exactly KEY_BYTES long
_local = threading.local()


@dataclass(frozen=True)
class Namespace:
    """Everything that must never share KV: model, layout, TP layout, tenant.

    Two namespaces that differ in any field produce disjoint key spaces.
    """

    model: str
    layout: KVLayout | str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("Namespace.model must be a non-empty string")
        if not (isinstance(self.tp_size, int) and self.tp_size >= 1):
            raise ValueError(f"Namespace.tp_size must be an int >= 1, got {self.tp_size!r}")
        if not (isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(
                f"Namespace.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}"
            )
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise ValueError("Namespace.tenant must be a string or None")

    def canonical(self) -> bytes:
        """Stable byte encoding of every field (sorted JSON, UTF-8)."""
        layout = self.layout.descriptor() if isinstance(self.layout, KVLayout) else self.layout
        fields: dict[str, Any] = {
            "model": self.model,
            "layout": layout,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "tenant": self.tenant,
        }
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """16-byte digest of the namespace; part of every block key's input."""
        return xxhash.xxh3_128_digest(_FORMAT_TAG + self.canonical())


def root_key(namespace: Namespace, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> BlockKey:
    """The parent of a prompt's first block: fixed per (namespace, block size)."""
    payload = _FORMAT_TAG + b"root" + namespace.digest() + block_tokens.to_bytes(4, "little")
    return xxhash.xxh3_128_digest(payload)


def block_keys(
    tokens: Sequence[int] | np.ndarray | Any,
    namespace: Namespace,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[BlockKey]:
    """Keys of every full block of ``tokens`` (list, numpy array or torch tensor).

    Cost is one vectorised conversion plus one xxh3 call per block: no Python
    work per token.
    """
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a kvpool.Namespace, got {type(namespace).__name__}")
    if not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    ids = token_array(tokens, convert=False)
    n_blocks = ids.size // block_tokens
    if n_blocks == 0:
        return []
    # One row per block: [parent (16) | namespace digest (16) | tokens (4*B)].
    # The namespace and token columns are filled in one vectorised step each
    # (tokens converted to int32 on the way); only the parent column is
    # written block by block, since it chains. Rows live in a reused,
    # already-faulted scratch buffer: fresh memory costs more than the hashing.
    row = 2 * KEY_BYTES + 4 * block_tokens
    rows = _scratch(n_blocks * row).reshape(n_blocks, row)
    rows[:, KEY_BYTES : 2 * KEY_BYTES] = np.frombuffer(namespace.digest(), dtype=np.uint8)
    token_columns = rows[:, 2 * KEY_BYTES :].view("<i4")
    np.copyto(
        token_columns,
        ids[: n_blocks * block_tokens].reshape(n_blocks, block_tokens),
        casting="unsafe",
    )
    flat = memoryview(rows.data).cast("B")
    digest = xxhash.xxh3_128_digest
    parent = root_key(namespace, block_tokens)
    keys: list[BlockKey] = []
    append = keys.append
    for start in range(0, n_blocks * row, row):
        flat[start : start + KEY_BYTES] = parent
        parent = digest(flat[start : start + row])
        append(parent)
    return keys


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread uint8 buffer of at least ``nbytes``, reused across calls."""
    buffer: np.ndarray | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)  # faults once, then reused
        _local.buffer = buffer
    return buffer[:nbytes]


def token_array(tokens: Any, convert: bool = True) -> np.ndarray:
    """Token ids as a 1-D integer array whose values fit int32 (checked).

    With ``convert`` the result is a contiguous little-endian int32 copy;
    without, the caller converts (``block_keys`` casts straight into its rows).
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch.Tensor
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.itemsize > 4 or arr.dtype == np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"token ids must fit in int32, got range [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype="<i4") if convert else arr
