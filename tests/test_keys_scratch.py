"""block_keys' reused per-thread scratch never leaks one call's inputs into another.

block_keys keeps rows (parent | namespace digest | tokens) and their views
per thread across calls; every test here compares against a from-scratch
reference spelled out with plain xxhash.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from kvpool import Namespace, block_keys
from kvpool.index.keys import root_key, token_array


def _reference(tokens: np.ndarray, ns: Namespace, block: int) -> list[bytes]:
    ids = np.asarray(tokens).astype("<i4")
    parent, out = root_key(ns, block), []
    for b in range(ids.size // block):
        parent = xxhash.xxh3_128_digest(
            parent + ns.digest() + ids[b * block : (b + 1) * block].tobytes()
        )
        out.append(parent)
    return out


def test_alternating_namespaces_block_sizes_and_lengths() -> None:
    rng = np.random.default_rng(7)
    a, b = Namespace("m-a"), Namespace("m-b", tenant="t")
    for step in range(40):
        ns = (a, b)[step % 2]
        block = (16, 512, 64)[step % 3]
        tokens = rng.integers(0, 50_000, int(rng.integers(0, 6000)), dtype=np.int64)
        assert block_keys(tokens, ns, block) == _reference(tokens, ns, block)


def test_more_blocks_than_the_cached_scratch_holds() -> None:
    tokens = np.arange(5000 * 4, dtype=np.int32)  # 5000 blocks of 4 > the cached 4096 rows
    ns = Namespace("big")
    assert block_keys(tokens, ns, 4) == _reference(tokens, ns, 4)
    small = tokens[:40]
    assert block_keys(small, ns, 4) == _reference(small, ns, 4)


def test_threads_hash_concurrently() -> None:
    ns = [Namespace(f"m{i}") for i in range(4)]
    prompts = [np.random.default_rng(i).integers(0, 32_000, 8192) for i in range(4)]
    want = [_reference(p, n, 512) for p, n in zip(prompts, ns, strict=True)]
    errors: list[int] = []

    def work(i: int) -> None:
        for _ in range(50):
            if block_keys(prompts[i], ns[i]) != want[i]:
                errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_namespace_digest_is_cached_and_stable() -> None:
    ns = Namespace("m", tenant="x")
    first = ns.digest()
    assert ns.digest() is first
    assert Namespace("m", tenant="x").digest() == first
    assert ns == Namespace("m", tenant="x") and hash(ns) == hash(Namespace("m", tenant="x"))


@pytest.mark.parametrize(
    ("values", "dtype", "ok"),
    [
        ([0, 5, 2**31 - 1], np.int64, True),
        ([-5, 3, -(2**31)], np.int64, True),
        ([2**31], np.int64, False),
        ([-(2**31) - 1, 0], np.int64, False),
        ([2**31 - 1], np.uint32, True),
        ([2**31], np.uint32, False),
        ([2**63 + 1], np.uint64, False),
        ([7], np.uint64, True),
    ],
)
def test_int32_range_check(values: list[int], dtype: type, ok: bool) -> None:
    arr = np.array(values, dtype=dtype)
    if ok:
        assert token_array(arr).tolist() == [int(v) for v in values]
    else:
        with pytest.raises(ValueError, match="fit in int32"):
            token_array(arr)
