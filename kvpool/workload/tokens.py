"""Token ids for trace records: same hash id => same block of tokens.

``tokens_for_request`` turns a record into concrete token ids (the last
block is cut to ``input_length``), so the pool's own chained hashing
(``kvpool.index.keys.block_keys``) reproduces the trace's sharing exactly:
two records that share their first k full blocks' ids get exactly k equal
leading block keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvpool.workload.traces import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_VOCAB_SIZE,
    TraceRecord,
    parse_record,
)

_MAX_HASH_ID = 2**64 - 1


def _digits_needed(vocab_size: int) -> int:
    n, span = 0, 1
    while span <= _MAX_HASH_ID:
        span *= vocab_size
        n += 1
    return n


def block_tokens_for_ids(
    hash_ids: Iterable[int],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> np.ndarray:
    """A (len(ids), block_tokens) int32 array: the token block named by each id.

    Row i depends only on ``hash_ids[i]``: its first few tokens are the id's
    digits in base ``vocab_size`` (so distinct ids always give distinct
    blocks) and the rest is a splitmix64 stream seeded by the id. All tokens
    lie in ``[0, vocab_size)``.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    digits = _digits_needed(vocab_size)
    if block_tokens < digits:
        raise ValueError(
            f"block_tokens={block_tokens} is too small to name 64-bit ids with a "
            f"vocabulary of {vocab_size} (needs >= {digits})"
        )
    ids = np.fromiter((int(h) for h in hash_ids), dtype=np.uint64)
    pos = np.arange(block_tokens, dtype=np.uint64)
    z = ids[:, None] * np.uint64(0x9E3779B97F4A7C15) + (pos[None, :] + np.uint64(1)) * np.uint64(
        0xD1B54A32D192ED03
    )
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    out = (z % np.uint64(vocab_size)).astype(np.int32)
    rest = ids.copy()
    v = np.uint64(vocab_size)
    for j in range(digits):
        out[:, j] = (rest % v).astype(np.int32)
        rest //= v
    return out


def tokens_for_request(
    record: TraceRecord | Mapping[str, Any],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> np.ndarray:
    """The prompt's token ids (int32, length ``input_length``) for a record.

    Block i is ``block_tokens_for_ids([hash_ids[i]])``; the last block is cut
    so the prompt has exactly ``input_length`` tokens. Same id => same
    tokens, so ``block_keys`` over the result shares exactly the full blocks
    whose leading ids are shared.
    """
    if not isinstance(record, TraceRecord):
        record = parse_record(record, block_tokens=None)
    n_in = record.input_length
    capacity = len(record.hash_ids) * block_tokens
    if n_in > capacity:
        raise ValueError(
            f"input_length {n_in} exceeds {len(record.hash_ids)} block(s) of {block_tokens} tokens"
        )
    if n_in == 0:
        return np.empty(0, dtype=np.int32)
    need = -(-n_in // block_tokens)
    blocks = block_tokens_for_ids(record.hash_ids[:need], block_tokens, vocab_size)
    return blocks.reshape(-1)[:n_in]
