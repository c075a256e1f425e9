"""Chained block keys: format, determinism, prefix property, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import KVLayout, Namespace, block_keys
from kvpool.index.keys import root_key

NS = Namespace("llama2-7b")

# Pinned bytes: if these change, every stored block in every deployment
# becomes unreachable. Change them only with a new key format version.
GOLDEN_NS_DIGEST = "e13a4180bfb2e3238c20794ad1e495d5"
GOLDEN_KEYS = [
    "c03e2d641cd4f61dd8c334871a7303e5",
    "30963ea5e9e1024e1926c90445d906da",
]


def test_golden_keys_pin_the_format() -> None:
    keys = block_keys(np.arange(1024), NS)
    assert NS.digest().hex() == GOLDEN_NS_DIGEST
    assert [k.hex() for k in keys] == GOLDEN_KEYS


def test_key_is_xxh3_128_of_parent_namespace_and_int32_tokens() -> None:
    """The format, spelled out with plain xxhash: no hidden inputs."""
    tokens = np.arange(1024)
    ns_digest = xxhash.xxh3_128_digest(b"kvpool/key/v1\x00" + NS.canonical())
    root = xxhash.xxh3_128_digest(
        b"kvpool/key/v1\x00root" + ns_digest + (512).to_bytes(4, "little")
    )
    first = xxhash.xxh3_128_digest(root + ns_digest + tokens[:512].astype("<i4").tobytes())
    second = xxhash.xxh3_128_digest(first + ns_digest + tokens[512:].astype("<i4").tobytes())
    assert block_keys(tokens, NS) == [first, second]


def test_only_full_blocks_get_keys() -> None:
    assert block_keys(np.arange(511), NS) == []
    assert len(block_keys(np.arange(512), NS)) == 1
    assert len(block_keys(np.arange(1535), NS)) == 2
    assert len(block_keys(np.arange(100), NS, block_tokens=16)) == 6


def test_keys_are_16_bytes_and_chain_from_the_root() -> None:
    keys = block_keys(np.arange(2048), NS)
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 4
    assert root_key(NS) not in keys


def test_list_numpy_and_torch_inputs_agree() -> None:
    tokens = list(range(5000, 5000 + 1536))
    expected = block_keys(tokens, NS)
    assert block_keys(np.array(tokens, dtype=np.int64), NS) == expected
    assert block_keys(np.array(tokens, dtype=np.int32), NS) == expected
    assert block_keys(torch.tensor(tokens), NS) == expected
    assert block_keys(torch.tensor(tokens, dtype=torch.int32), NS) == expected


def test_different_namespaces_never_share_keys() -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)
    spaces = [
        Namespace("llama2-7b"),
        Namespace("llama2-13b"),
        Namespace("llama2-7b", layout=layout),
        Namespace("llama2-7b", layout=KVLayout(32, 8, 128, dtype="float16")),
        Namespace("llama2-7b", tp_rank=1, tp_size=2),
        Namespace("llama2-7b", tp_rank=0, tp_size=2),
        Namespace("llama2-7b", tenant="acme"),
    ]
    tokens = np.arange(1024)
    all_keys = [k for ns in spaces for k in block_keys(tokens, ns)]
    assert len(set(all_keys)) == len(all_keys)


def test_block_size_is_part_of_the_key_space() -> None:
    tokens = np.arange(1024)
    a = block_keys(tokens, NS, block_tokens=256)
    b = block_keys(tokens, NS, block_tokens=512)
    assert not set(a) & set(b)


def test_deterministic_across_processes_and_hash_seeds() -> None:
    script = (
        "import numpy as np, kvpool;"
        "print(','.join(k.hex() for k in kvpool.block_keys("
        "np.arange(3000) * 7 % 32000, kvpool.Namespace('m', tenant='t'))))"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1
    local = ",".join(
        k.hex() for k in block_keys(np.arange(3000) * 7 % 32000, Namespace("m", tenant="t"))
    )
    assert outputs == {local}


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(0, 50_000), min_size=0, max_size=80),
    b=st.lists(st.integers(0, 50_000), min_size=0, max_size=80),
)
def test_equal_leading_keys_iff_equal_prefix(a: list[int], b: list[int]) -> None:
    block = 8
    ka, kb = block_keys(a, NS, block), block_keys(b, NS, block)
    shared_keys = 0
    while shared_keys < min(len(ka), len(kb)) and ka[shared_keys] == kb[shared_keys]:
        shared_keys += 1
    shared_tokens = 0
    while shared_tokens < min(len(a), len(b)) and a[shared_tokens] == b[shared_tokens]:
        shared_tokens += 1
    assert shared_keys == min(shared_tokens // block, len(ka), len(kb))
    # After the first differing block no key matches again, anywhere.
    assert not set(ka[shared_keys:]) & set(kb)


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        (np.zeros((2, 512), dtype=np.int32), ValueError),
        (np.zeros(512, dtype=np.float32), TypeError),
        (np.array([2**31] * 512, dtype=np.int64), ValueError),
        (np.array([-(2**31) - 1] * 512, dtype=np.int64), ValueError),
        (["a"] * 512, TypeError),
    ],
)
def test_bad_tokens_raise_clear_errors(tokens: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        block_keys(tokens, NS)


def test_bad_namespace_and_block_size() -> None:
    with pytest.raises(TypeError):
        block_keys([1] * 512, "llama")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        block_keys([1] * 512, NS, block_tokens=0)
    with pytest.raises(ValueError):
        Namespace("")
    with pytest.raises(ValueError):
        Namespace("m", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        KVLayout(0, 8, 128)
    with pytest.raises(ValueError):
        KVLayout(32, 8, 128, dtype="float64")


def test_layout_sizes_match_llama2_70b() -> None:
    layout = KVLayout(num_layers=80, num_kv_heads=8, head_dim=128)
    assert layout.bytes_per_token == 327_680
    assert layout.layer_bytes == 2 << 20
    assert layout.block_bytes == 160 << 20
