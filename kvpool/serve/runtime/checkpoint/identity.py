"""The weights' identity: a digest that differs between any two checkpoints we could tell apart.

Hashing every byte of a 140 GB checkpoint would add minutes to every start,
so the digest covers each shard's name, size and safetensors header (every
tensor's name, dtype, shape and offsets) in full, plus ``SAMPLES`` evenly
spaced ``SAMPLE_BYTES`` windows of its data. Two checkpoints of the same
shapes that differ in their weights (a fine-tune, another seed) differ in
practically every window; a checkpoint edited in place in bytes no window
covers would keep its digest (documented limit).
"""

from __future__ import annotations

import pathlib
import struct

import xxhash

SAMPLES = 64
SAMPLE_BYTES = 4096


def weights_digest(path: pathlib.Path, shard_files: list[str]) -> str:
    """Hex xxh3-128 over config.json and every shard's header and sampled data."""
    h = xxhash.xxh3_128()
    h.update((path / "config.json").read_bytes())
    for name in shard_files:
        f = path / name
        size = f.stat().st_size
        h.update(f"{name}\0{size}\0".encode())
        with f.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(header_len))
            data_start = 8 + header_len
            span = max(0, size - data_start - SAMPLE_BYTES)
            for i in range(SAMPLES):
                fh.seek(data_start + span * i // max(1, SAMPLES - 1))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()
