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
        """16-byte digest of the namespace; part of every block key's input.

        Computed once per namespace (it is immutable) and cached: block_keys
        needs it on every call.
        """
        cached: bytes | None = self.__dict__.get("_digest")
        if cached is None:
            cached = xxhash.xxh3_128_digest(_FORMAT_TAG + self.canonical())
            object.__setattr__(self, "_digest", cached)  # frozen: cache beside the fields
        return cached


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
    work per token, no allocation or slicing per block in steady state.
    """
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a kvpool.Namespace, got {type(namespace).__name__}")
    if not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    ids = token_array(tokens, convert=False)
    n_blocks = ids.size // block_tokens
    if n_blocks == 0:
        return []
    # One row per block: [parent (16) | namespace digest (16) | tokens (4*B)],
    # so each key is one xxh3 call over one contiguous row. The token columns
    # are filled in one vectorised step (converted to int32 on the way); only
    # the parent column is written block by block, since it chains. Rows, and
    # the memoryviews of each row and its parent slot, live in a per-thread
    # scratch reused across calls: fresh memory and per-block slicing cost
    # more than the hashing itself.
    rows = _Rows.get(n_blocks, block_tokens)
    rows.fill(namespace.digest(), ids[: n_blocks * block_tokens])
    digest = xxhash.xxh3_128_digest
    parent = _root(namespace, block_tokens)
    keys: list[BlockKey] = []
    append = keys.append
    whole = _WHOLE  # a prebuilt slice: no slice object built per block
    for head, row in zip(rows.heads[:n_blocks], rows.rows[:n_blocks], strict=True):
        head[whole] = parent
        parent = digest(row)
        append(parent)
    return keys


_WHOLE = slice(None)
_CACHED_ROWS = 4096  # 2M tokens at 512 per block
_ROOTS: dict[tuple[Namespace, int], BlockKey] = {}


def _root(namespace: Namespace, block_tokens: int) -> BlockKey:
    """``root_key``, memoised (a handful of namespaces per process)."""
    key = (namespace, block_tokens)
    root = _ROOTS.get(key)
    if root is None:
        if len(_ROOTS) >= 256:
            _ROOTS.clear()
        root = _ROOTS[key] = root_key(namespace, block_tokens)
    return root


class _Rows:
    """Per-thread scratch rows for ``block_keys`` plus per-row memoryviews.

    Invariant: ``heads[i]`` is the 16-byte parent slot of ``rows[i]``, both
    views into ``buffer``; ``digest_in`` names the namespace digest already
    written into every row's second column (so it is rewritten only when the
    namespace changes).
    """

    def __init__(self, n_blocks: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        size = 2 * KEY_BYTES + 4 * block_tokens
        self.buffer = np.empty((n_blocks, size), dtype=np.uint8)
        self.buffer.fill(0)  # fault the pages in once
        flat = memoryview(self.buffer.data).cast("B")
        self.rows = [flat[i : i + size] for i in range(0, n_blocks * size, size)]
        self.heads = [row[:KEY_BYTES] for row in self.rows]
        self.digest_in = b""

    @staticmethod
    def get(n_blocks: int, block_tokens: int) -> _Rows:
        """This thread's rows when they fit; a bigger set replaces them, up to
        ``_CACHED_ROWS`` rows (beyond that, a one-off set: ~200 B of views per row)."""
        rows: _Rows | None = getattr(_local, "rows", None)
        if rows is not None and rows.block_tokens == block_tokens and len(rows.rows) >= n_blocks:
            return rows
        if n_blocks > _CACHED_ROWS:
            return _Rows(n_blocks, block_tokens)
        rows = _Rows(max(n_blocks, 256), block_tokens)
        _local.rows = rows
        return rows

    def fill(self, ns_digest: bytes, ids: np.ndarray) -> None:
        n = ids.size // self.block_tokens
        if self.digest_in != ns_digest:
            self.buffer[:, KEY_BYTES : 2 * KEY_BYTES] = np.frombuffer(ns_digest, dtype=np.uint8)
            self.digest_in = ns_digest
        tokens = self.buffer[:n, 2 * KEY_BYTES :].view("<i4")
        np.copyto(tokens, ids.reshape(n, self.block_tokens), casting="unsafe")


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
    if (arr.dtype.itemsize > 4 or arr.dtype == np.uint32) and not _fits_int32(arr):
        lo, hi = int(arr.min()), int(arr.max())
        raise ValueError(f"token ids must fit in int32, got range [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype="<i4") if convert else arr


def _fits_int32(arr: np.ndarray) -> bool:
    """Every value in [-2**31, 2**31). One pass for the usual non-negative ids: their
    bitwise OR is below 2**31 iff every id is; min and max only when some id is
    negative (the OR of signed values is negative iff one is)."""
    ored = int(np.bitwise_or.reduce(arr))
    if ored >= 0:
        return ored <= _INT32_MAX
    return int(arr.min()) >= _INT32_MIN and int(arr.max()) <= _INT32_MAX
