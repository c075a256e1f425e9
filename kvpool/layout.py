"""KV layout: the shape of one block's keys and values, per layer.

A block of ``block_tokens`` tokens is stored as ``num_layers`` parts, one per
layer, each holding K then V: ``2 x block_tokens x num_kv_heads x head_dim``
elements of ``dtype``. The layout is part of a block's namespace, because KV
computed under one layout is meaningless under another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class KVLayout:
    """Per-layer geometry of a KV block; immutable and hashable."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(_DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def half_layer_bytes(self) -> int:
        """Bytes of K (or of V) for one layer of one block."""
        return self.block_tokens * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one (block, layer) part: K followed by V."""
        return 2 * self.half_layer_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of a whole block across all layers."""
        return self.num_layers * self.layer_bytes

    def layer_reads(
        self, layer: int, keys: Sequence[bytes]
    ) -> tuple[list[bytes], list[int], list[int | None]]:
        """``get_into_batch``'s keys, offsets and lengths that read ``layer`` of the
        blocks ``keys``: each block's K range, then its V range (each key named twice
        in a row; the caller's outs follow the same order)."""
        base, half = layer * self.layer_bytes, self.half_layer_bytes
        pieces = [key for key in keys for _ in range(2)]
        return pieces, [base, base + half] * len(keys), [half] * len(pieces)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def descriptor(self) -> str:
        """Canonical text naming this layout; it feeds the namespace hash."""
        return (
            f"L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":{self.dtype}:T{self.block_tokens}"
        )
