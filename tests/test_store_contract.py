"""The store contract (kvpool.api.KVStore): the same cases on every store.

Each test runs on four stores: an embedded pool in DRAM, an embedded pool
with a two-block DRAM tier over SSD (so blocks really move to SSD and back), and
the cluster client over shared memory and over TCP (one master + node per
transport, started once for the module). Cluster clients are fresh per test
and every test uses its own keys, so tests cannot see each other's blocks.

Documented, tested differences between the stores:

- a block larger than any tier: the embedded pool knows its tier sizes and
  raises ``BlockTooLargeError``; the cluster's master raises ``PoolFullError``
  ("no node can hold a block of N bytes") — both before anything is stored;
- ``stats()``: every store reports ``mode``, ``policy``, ``blocks`` and
  ``transport``; the rest is store-specific (tiers vs. nodes and client);
- ``locate`` names ``"embedded"`` for an embedded pool, node ids for a cluster.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from clusterhelpers import Cluster, start_cluster
from poolhelpers import BLOCK, make_keys, payload

import kvpool
from kvpool import (
    BlockTooLargeError,
    BufferSpecError,
    InvalidKeyError,
    KVPoolError,
    Pool,
    PoolClosedError,
    PoolFullError,
)
from kvpool.api import BlockWriter, KVStore

STORES = ["dram", "dram+ssd", "cluster-shm", "cluster-tcp"]


@pytest.fixture(scope="module")
def shm_cluster() -> Iterator[Cluster]:
    cluster = start_cluster(["64MiB"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def tcp_cluster() -> Iterator[Cluster]:
    cluster = start_cluster(["64MiB"])
    yield cluster
    cluster.stop()


@pytest.fixture(params=STORES)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_store(
    kind: str, request: pytest.FixtureRequest, tmp_path: object
) -> Iterator[Callable[[], KVStore]]:
    """Makes stores of this test's kind; closes them all afterwards."""
    made: list[KVStore] = []

    def make() -> KVStore:
        store: KVStore
        if kind == "dram":
            store = Pool.embedded(dram_bytes=16 * BLOCK)
        elif kind == "dram+ssd":
            store = Pool.embedded(
                dram_bytes=2 * BLOCK, ssd_path=f"{tmp_path}/{len(made)}", ssd_bytes=32 * BLOCK
            )
        else:
            transport = kind.removeprefix("cluster-")
            cluster: Cluster = request.getfixturevalue(f"{transport}_cluster")
            store = kvpool.connect(cluster.url, timeout=10, transport=transport)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def store(new_store: Callable[[], KVStore]) -> KVStore:
    return new_store()


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> list[bytes]:
    """Keys no other test uses (the cluster stores outlive a test)."""
    return make_keys(12, seed=zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def loaded(store: KVStore, keys: list[bytes]) -> KVStore:
    """``store`` holding payload(i) under keys[i] for i < 3."""
    for i in range(3):
        assert store.put(keys[i], payload(i), parent=keys[i - 1] if i else None)
    return store


def assert_intact(store: KVStore, keys: list[bytes], blocks: int | None = None) -> None:
    """keys[:3] hold their payloads, and nothing else of ``keys`` is stored."""
    assert store.exists(keys) == [True] * 3 + [False] * (len(keys) - 3)
    for i in range(3):
        assert store.get(keys[i]) == payload(i).tobytes()
    if blocks is not None:
        assert store.stats()["blocks"] == blocks


def test_every_store_implements_the_contract(store: KVStore) -> None:
    assert isinstance(store, KVStore)


# -- basic ----------------------------------------------------------------------------


def test_put_get_exact_bytes(store: KVStore, keys: list[bytes]) -> None:
    data = payload(1)
    assert store.put(keys[0], data) is True
    assert store.get(keys[0]) == data.tobytes()
    out = np.empty(BLOCK, np.uint8)
    assert store.get_into(keys[0], out) == BLOCK
    assert np.array_equal(out, data)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a.tobytes(),
        lambda a: bytearray(a.tobytes()),
        lambda a: memoryview(a.tobytes()),
        lambda a: a.view(np.float32).reshape(64, -1),
        lambda a: torch.from_numpy(a.copy()).view(torch.bfloat16).reshape(8, -1),
        lambda a: torch.from_numpy(a.copy()).view(torch.int64),
    ],
    ids=["bytes", "bytearray", "memoryview", "numpy-2d-f32", "torch-bf16", "torch-i64"],
)
def test_every_buffer_type_round_trips(store: KVStore, keys: list[bytes], make: object) -> None:
    data = payload(7)
    assert store.put(keys[0], make(data))  # type: ignore[operator]
    for out in (
        np.zeros(BLOCK, np.uint8),
        torch.zeros(BLOCK // 2, dtype=torch.float16),
        bytearray(BLOCK),
    ):
        assert store.get_into(keys[0], out) == BLOCK
        raw = out.numpy() if torch.is_tensor(out) else np.asarray(out)
        assert raw.view(np.uint8).tobytes() == data.tobytes()


def test_out_may_be_larger_than_the_block(store: KVStore, keys: list[bytes]) -> None:
    store.put(keys[0], b"abc")
    out = bytearray(10)
    assert store.get_into(keys[0], out) == 3
    assert out == b"abc" + bytes(7)


def test_miss_returns_none(store: KVStore, keys: list[bytes]) -> None:
    assert store.get(keys[0]) is None
    assert store.get_into(keys[0], np.empty(8, np.uint8)) is None
    assert store.get_into_batch(keys[:2], [bytearray(8), bytearray(8)]) == [None, None]


def test_put_of_an_existing_key_is_a_noop(store: KVStore, keys: list[bytes]) -> None:
    assert store.put(keys[0], b"first")
    assert store.put(keys[0], b"second") is False
    assert store.get(keys[0]) == b"first"


def test_prefix_match_and_exists(store: KVStore, keys: list[bytes]) -> None:
    assert store.prefix_match(keys) == 0
    for key in keys[:4]:
        store.put(key, b"x" * 100)
    store.put(keys[6], b"x")
    assert store.prefix_match(keys) == 4
    assert store.prefix_match(keys[:3]) == 3
    assert store.prefix_match([]) == 0
    assert store.exists(keys[:7]) == [True] * 4 + [False, False, True]
    assert store.exists([]) == []


def test_remove(store: KVStore, keys: list[bytes]) -> None:
    blocks = store.stats()["blocks"]
    store.put(keys[0], payload(0))
    assert store.remove(keys[0]) is True
    assert store.remove(keys[0]) is False
    assert store.get(keys[0]) is None
    assert store.stats()["blocks"] == blocks
    assert store.put(keys[0], b"again")
    assert store.get(keys[0]) == b"again"


def test_batch_forms(store: KVStore, keys: list[bytes]) -> None:
    datas = [payload(i, 4096 + i) for i in range(5)]
    assert store.put_batch(keys[:5], datas, parents=[None, *keys[:4]]) == [True] * 5
    assert store.put_batch(keys[:2], datas[:2]) == [False, False]
    outs = [np.empty(8192, np.uint8) for _ in range(6)]
    assert store.get_into_batch(keys[:6], outs) == [4096, 4097, 4098, 4099, 4100, None]
    for out, data in zip(outs, datas, strict=False):
        assert np.array_equal(out[: data.size], data)
    assert store.put_batch([], []) == []


def test_stats_shape(store: KVStore, keys: list[bytes], kind: str) -> None:
    blocks = store.stats()["blocks"]
    store.put(keys[0], payload(0))
    stats = store.stats()
    assert stats["mode"] == ("distributed" if kind.startswith("cluster") else "embedded")
    assert stats["blocks"] == blocks + 1
    assert isinstance(stats["policy"], str)
    cluster = kind.startswith("cluster")
    assert stats["transport"] == (kind.removeprefix("cluster-") if cluster else "local")


def test_locate_and_replicate(store: KVStore, keys: list[bytes]) -> None:
    store.put(keys[0], payload(0))
    located = store.locate(keys[:2])
    assert len(located[0]) == 1 and located[1] == []
    assert store.replicate(keys[:2]) == 0  # one node: nowhere to put a second copy


def test_replicas_beyond_the_node_count_store_one_copy(store: KVStore, keys: list[bytes]) -> None:
    assert store.put(keys[0], payload(0), replicas=2)
    assert store.get(keys[0]) == payload(0).tobytes()
    assert len(store.locate(keys[:1])[0]) == 1


# -- reserve / BlockWriter ------------------------------------------------------------


def test_reserved_block_is_invisible_until_commit(store: KVStore, keys: list[bytes]) -> None:
    data = payload(5)
    writer = store.reserve(keys[0], BLOCK)
    assert writer is not None
    for part in range(4)[::-1]:  # any order
        writer.write(part * BLOCK // 4, data[part * BLOCK // 4 : (part + 1) * BLOCK // 4])
        assert store.exists(keys[:1]) == [False]
    assert store.reserve(keys[0], BLOCK) is None  # already being written
    writer.commit()
    assert store.get(keys[0]) == data.tobytes()
    assert store.reserve(keys[0], BLOCK) is None  # already stored
    with pytest.raises(KVPoolError):
        writer.commit()
    with pytest.raises(KVPoolError):
        writer.write(0, b"late")


def test_abort_and_exceptions_leave_nothing(store: KVStore, keys: list[bytes]) -> None:
    blocks = store.stats()["blocks"]
    writer = store.reserve(keys[0], BLOCK, parent=None)
    assert writer is not None
    writer.write(0, payload(0)[:100])
    writer.abort()
    writer.abort()  # idempotent
    assert store.exists(keys[:1]) == [False]
    with pytest.raises(RuntimeError, match="producer"), store.reserve(keys[0], BLOCK) as w:  # type: ignore[union-attr]
        w.write(0, payload(0))
        raise RuntimeError("producer failed")
    assert store.exists(keys[:1]) == [False]
    assert store.stats()["blocks"] == blocks
    with store.reserve(keys[0], BLOCK) as w:  # type: ignore[union-attr]  # the key is free again
        w.write(0, payload(1))
    assert store.get(keys[0]) == payload(1).tobytes()


def test_reserve_batch_answers_each_key_in_order(loaded: KVStore, keys: list[bytes]) -> None:
    """One writer or None per key, in order: None for a stored key, a key another
    writer reserved, and a key named again later in the same batch."""
    elsewhere = loaded.reserve(keys[3], BLOCK)
    assert elsewhere is not None
    batch = [keys[0], keys[3], keys[4], keys[4]]
    writers = loaded.reserve_batch(batch, [BLOCK] * 4, [None, None, keys[3], keys[3]])
    assert [w is None for w in writers] == [True, True, False, True]
    writer = writers[2]
    assert writer is not None and writer.key == keys[4] and writer.size == BLOCK
    writer.write(0, payload(4))
    assert loaded.exists(keys[3:5]) == [False, False]  # invisible until committed
    BlockWriter.commit_all([writer])
    elsewhere.abort()
    assert loaded.get(keys[4]) == payload(4).tobytes()
    assert loaded.exists(keys[3:5]) == [False, True]
    assert loaded.reserve_batch([], []) == []


def test_reserve_batch_is_all_or_nothing(loaded: KVStore, keys: list[bytes], kind: str) -> None:
    """A batch with a block no node or tier can hold raises (the documented error of
    each store) and leaves no reservation: every key of it can be reserved again."""
    blocks = loaded.stats()["blocks"]
    expected = PoolFullError if kind.startswith("cluster") else BlockTooLargeError
    with pytest.raises(expected):
        loaded.reserve_batch(keys[3:5], [BLOCK, 128 << 20])
    for w in loaded.reserve_batch(keys[3:5], [BLOCK, BLOCK]):  # nothing was left reserved
        assert w is not None
        w.abort()
    assert_intact(loaded, keys, blocks)


@pytest.mark.parametrize(
    ("sizes", "parents", "error", "match"),
    [
        ([BLOCK], None, ValueError, "same length"),
        ([BLOCK, BLOCK], [None], ValueError, "same length"),
        ([BLOCK, 0], None, BufferSpecError, "size must be a positive int"),
        ([BLOCK, 1.5], None, BufferSpecError, "size must be a positive int"),
        ([BLOCK, BLOCK], [None, b"short"], InvalidKeyError, None),
    ],
)
def test_bad_reserve_batches_reserve_nothing(
    loaded: KVStore,
    keys: list[bytes],
    sizes: list[object],
    parents: list[bytes | None] | None,
    error: type[Exception],
    match: str | None,
) -> None:
    with pytest.raises(error, match=match):
        loaded.reserve_batch(keys[3:5], sizes, parents)  # type: ignore[arg-type]
    assert_intact(loaded, keys)
    for w in loaded.reserve_batch(keys[3:5], [BLOCK, BLOCK]):  # nothing was left reserved
        assert w is not None
        w.abort()


def test_pieces_of_several_blocks_in_one_batch(store: KVStore, keys: list[bytes]) -> None:
    """``write_pieces`` / ``commit_all`` (what the layer writer uses): pieces of several
    reserved blocks, interleaved and in any order within a block, land as their own
    ``write`` calls would; every range is checked before any byte moves; the blocks
    become visible together, and a finished writer is refused."""
    quarter = BLOCK // 4
    writers = [store.reserve(keys[i], BLOCK) for i in range(2)]  # (the SSD store's DRAM: 2)
    assert all(w is not None for w in writers)
    group: list[BlockWriter] = [w for w in writers if w is not None]
    for part in (3, 0, 2, 1):  # a layer at a time: one piece of every block per batch
        BlockWriter.write_pieces(
            [(w, part * quarter, payload(i)[part * quarter : (part + 1) * quarter])
             for i, w in enumerate(group)]
        )  # fmt: skip
        assert store.exists(keys[:2]) == [False] * 2
    bad = [(group[0], 0, payload(9)[:quarter]), (group[1], BLOCK - 1, b"xx")]
    with pytest.raises(BufferSpecError, match="outside the block"):
        BlockWriter.write_pieces(bad)  # refused whole: its first piece moves nothing either
    BlockWriter.commit_all([])
    BlockWriter.commit_all(group)
    assert [store.get(k) for k in keys[:2]] == [payload(0).tobytes(), payload(1).tobytes()]
    with pytest.raises(KVPoolError):
        BlockWriter.commit_all(group[:1])
    with pytest.raises(KVPoolError):
        BlockWriter.write_pieces([(group[1], 0, b"late")])


def test_adjacent_pieces_of_a_block_in_one_batch(store: KVStore, keys: list[bytes]) -> None:
    """A layer-wise store's batch: each block's pieces back to back (K then V of a
    layer: the cluster client sends such a run as one write), then a piece that does
    not follow; each block reads back as its pieces would have written it."""
    eighth = BLOCK // 8
    writers = [store.reserve(keys[i], BLOCK) for i in range(2)]
    group: list[BlockWriter] = [w for w in writers if w is not None]
    assert len(group) == 2
    for layer in (1, 0):  # two eighths a layer, adjacent in each block
        at = 2 * layer * eighth
        BlockWriter.write_pieces(
            [(w, at + half * eighth, payload(i)[at + half * eighth : at + (half + 1) * eighth])
             for i, w in enumerate(group) for half in (0, 1)]
        )  # fmt: skip
    BlockWriter.write_pieces(
        [(w, at, payload(i)[at : at + eighth]) for i, w in enumerate(group)
         for at in (6 * eighth, 4 * eighth, 5 * eighth)]
        + [(group[0], 7 * eighth, payload(0)[7 * eighth :])]
        + [(group[1], 7 * eighth, payload(1)[7 * eighth :])]
    )  # fmt: skip
    BlockWriter.commit_all(group)
    assert [store.get(k) for k in keys[:2]] == [payload(0).tobytes(), payload(1).tobytes()]


@pytest.mark.parametrize("warm", [False, True], ids=["first-put", "later-puts"])
def test_a_put_racing_a_reservation_of_its_key(
    new_store: Callable[[], KVStore], keys: list[bytes], kind: str, warm: bool
) -> None:
    """Two writers of one key. ``put`` answers True only if its writer then reads its
    own bytes, whether the other writer's reservation later commits or aborts; False
    leaves the key to the reservation (absent again if that one aborts). The embedded
    store and a cluster client's first put defer to the reservation; a cluster
    client's later puts (keyless grants, commits pipelined) commit first and win,
    since their writer was told True before the master saw the key."""
    reserver = new_store()
    putter = new_store() if kind.startswith("cluster") else reserver
    if warm:
        putter.put(keys[10], payload(10))  # a cluster client then holds grants
    answers = []
    for key, ending in ((keys[0], "commit"), (keys[1], "abort")):
        writer = reserver.reserve(key, BLOCK)
        assert writer is not None
        writer.write(0, payload(1))
        stored = putter.put(key, payload(2))
        answers.append(stored)
        assert putter.exists([key]) == [stored]
        if stored:
            assert putter.get(key) == payload(2).tobytes()
        if ending == "commit":
            writer.commit()
        else:
            writer.abort()
        held = payload(2) if stored else payload(1) if ending == "commit" else None
        for store in (putter, reserver):
            assert store.get(key) == (None if held is None else held.tobytes())
    if kind.startswith("cluster"):  # each path was taken, as described above
        assert answers == [warm, True]  # a first put lends the client grants


def test_out_of_range_writes_are_refused(store: KVStore, keys: list[bytes]) -> None:
    with store.reserve(keys[0], 1000) as writer:  # type: ignore[union-attr]
        for offset, data in ((900, np.zeros(101, np.uint8)), (-1, b"x"), (1000, b"x")):
            with pytest.raises(BufferSpecError, match="outside the block"):
                writer.write(offset, data)
        with pytest.raises(BufferSpecError):
            writer.write(0, np.zeros(20, np.uint8)[::2])
        writer.write(0, np.full(1000, 7, np.uint8))
    assert store.get(keys[0]) == bytes([7]) * 1000


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "10"])
def test_bad_reserve_sizes(loaded: KVStore, keys: list[bytes], size: object) -> None:
    with pytest.raises(BufferSpecError, match="size must be a positive int"):
        loaded.reserve(keys[3], size)  # type: ignore[arg-type]
    assert_intact(loaded, keys)


# -- range reads ----------------------------------------------------------------------


def test_range_reads_return_exact_bytes(loaded: KVStore, keys: list[bytes]) -> None:
    out = np.zeros(BLOCK, np.uint8)
    assert loaded.get_into(keys[0], out, offset=1000, length=5000) == 5000
    assert np.array_equal(out[:5000], payload(0)[1000:6000])
    assert not out[5000:].any()
    assert loaded.get_into(keys[1], out, offset=BLOCK - 10) == 10
    assert np.array_equal(out[:10], payload(1)[-10:])
    assert loaded.get_into(keys[2], out, offset=0, length=BLOCK) == BLOCK
    assert loaded.get_into(keys[3], out, offset=10, length=10) is None  # a miss stays a miss


@pytest.mark.parametrize(
    ("offset", "length"),
    [(BLOCK, None), (BLOCK, 1), (0, BLOCK + 1), (BLOCK - 1, 2), (-1, 10), (10, 0), (10, -5)],
)
def test_bad_ranges(loaded: KVStore, keys: list[bytes], offset: int, length: int | None) -> None:
    out = np.zeros(BLOCK, np.uint8)
    with pytest.raises(BufferSpecError):
        loaded.get_into(keys[2], out, offset=offset, length=length)
    assert not out.any()
    assert_intact(loaded, keys)


def test_batch_range_reads_return_exact_bytes(loaded: KVStore, keys: list[bytes]) -> None:
    outs = [np.zeros(n, np.uint8) for n in (100, 5000, 10, 8)]
    got = loaded.get_into_batch(
        [keys[0], keys[0], keys[1], keys[3]],
        outs,
        offsets=[0, 1000, BLOCK - 10, 0],
        lengths=[100, 5000, None, 8],
    )
    assert got == [100, 5000, 10, None]  # a miss stays a miss
    assert np.array_equal(outs[0], payload(0)[:100])
    assert np.array_equal(outs[1], payload(0)[1000:6000])
    assert np.array_equal(outs[2], payload(1)[-10:])
    assert not outs[3].any()
    whole = [np.zeros(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)]
    assert loaded.get_into_batch(keys[1:3], whole, offsets=[0, 0]) == [BLOCK, BLOCK]
    assert loaded.get_into_batch(keys[1:3], whole, lengths=[BLOCK, 7]) == [BLOCK, 7]
    assert np.array_equal(whole[1][:7], payload(2)[:7])


@pytest.mark.parametrize(("offset", "length"), [(BLOCK, None), (0, BLOCK + 1), (BLOCK - 1, 2)])
def test_batch_ranges_past_the_block(
    loaded: KVStore, keys: list[bytes], offset: int, length: int | None
) -> None:
    out = np.zeros(BLOCK, np.uint8)
    with pytest.raises(BufferSpecError):
        loaded.get_into_batch([keys[2]], [out], offsets=[offset], lengths=[length])
    assert not out.any()
    assert_intact(loaded, keys)


@pytest.mark.parametrize(
    ("offsets", "lengths", "error"),
    [
        ([0], None, "one entry per key"),
        (None, [1, 2, 3], "one entry per key"),
        ([0, -1], None, "offset must be an int >= 0"),
        ([0, True], None, "offset must be an int >= 0"),
        (None, [5, 0], "length must be a positive int or None"),
        ([0, 0], [5, 2.0], "length must be a positive int or None"),
        (5, None, "must be sequences"),
    ],
)
def test_bad_batch_ranges(
    loaded: KVStore,
    keys: list[bytes],
    offsets: list[object] | None,
    lengths: list[object] | None,
    error: str,
) -> None:
    outs = [np.zeros(BLOCK, np.uint8), np.zeros(BLOCK, np.uint8)]
    with pytest.raises((BufferSpecError, ValueError), match=error):
        loaded.get_into_batch(keys[:2], outs, offsets=offsets, lengths=lengths)  # type: ignore[arg-type]
    assert not outs[0].any() and not outs[1].any()
    assert_intact(loaded, keys)


def test_range_longer_than_out(loaded: KVStore, keys: list[bytes]) -> None:
    with pytest.raises(BufferSpecError, match="out has 10 bytes but 100 are asked"):
        loaded.get_into(keys[0], bytearray(10), offset=5, length=100)


# -- leases ---------------------------------------------------------------------------


def test_lease_pins_the_stored_prefix(store: KVStore, keys: list[bytes]) -> None:
    for i in (0, 1, 3):
        store.put(keys[i], payload(i))
    with store.lease(keys[:5]) as lease:
        assert len(lease) == 2 and lease.keys == keys[:2]
        out = np.empty(BLOCK, np.uint8)
        assert store.get_into(keys[1], out, offset=7, length=100) == 100
        assert np.array_equal(out[:100], payload(1)[7:107])
    with store.lease(keys[:5], prefix=False) as every:
        assert every.keys == [keys[0], keys[1], keys[3]]
    with store.lease(keys[5:8]) as nothing:
        assert len(nothing) == 0 and nothing.keys == []
    assert store.lease([]).keys == []


def test_release_twice_and_remove_under_a_lease(store: KVStore, keys: list[bytes]) -> None:
    store.put(keys[0], payload(0))
    lease = store.lease(keys[:1])
    assert store.remove(keys[0])  # hidden at once, freed on release
    assert store.get(keys[0]) is None and store.exists(keys[:1]) == [False]
    lease.release()
    lease.release()
    assert store.put(keys[0], payload(1))
    assert store.get(keys[0]) == payload(1).tobytes()


# -- bad input: the same error, and nothing changed ----------------------------------


@pytest.mark.parametrize("key", ["abc", bytearray(16), 12, b"short", b"x" * 17, None])
def test_bad_keys(loaded: KVStore, keys: list[bytes], key: object) -> None:
    blocks = loaded.stats()["blocks"]
    bad: object = key
    for call in (
        lambda: loaded.put(bad, b"data"),  # type: ignore[arg-type]
        lambda: loaded.put_batch([keys[3], bad], [b"a", b"b"]),  # type: ignore[list-item]
        lambda: loaded.reserve(bad, 10),  # type: ignore[arg-type]
        lambda: loaded.get(bad),  # type: ignore[arg-type]
        lambda: loaded.get_into(bad, bytearray(8)),  # type: ignore[arg-type]
        lambda: loaded.get_into_batch([keys[0], bad], [bytearray(8)] * 2),  # type: ignore[list-item]
        lambda: loaded.exists([keys[0], bad]),  # type: ignore[list-item]
        lambda: loaded.prefix_match([keys[0], bad]),  # type: ignore[list-item]
        lambda: loaded.lease([keys[0], bad]),  # type: ignore[list-item]
        lambda: loaded.locate([bad]),  # type: ignore[list-item]
        lambda: loaded.replicate([bad]),  # type: ignore[list-item]
        lambda: loaded.remove(bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidKeyError):
            call()
    if key is not None:  # None is a valid parent: "first block"
        for call in (
            lambda: loaded.put(keys[3], b"x", parent=bad),  # type: ignore[arg-type]
            lambda: loaded.put_batch([keys[3]], [b"x"], [bad]),  # type: ignore[list-item]
            lambda: loaded.reserve(keys[3], 10, parent=bad),  # type: ignore[arg-type]
        ):
            with pytest.raises(InvalidKeyError, match="parent"):
                call()
    assert_intact(loaded, keys, blocks)


@pytest.mark.parametrize(
    "data",
    [
        np.zeros(2 * BLOCK, np.uint8)[::2],
        torch.zeros(256, 256, dtype=torch.uint8).t(),
        b"",
        np.zeros(0, np.uint8),
        "a string",
        12345,
    ],
    ids=["numpy-strided", "torch-transposed", "empty-bytes", "empty-array", "str", "int"],
)
def test_bad_data_buffers(loaded: KVStore, keys: list[bytes], data: object) -> None:
    blocks = loaded.stats()["blocks"]
    with pytest.raises(BufferSpecError):
        loaded.put(keys[3], data)
    with pytest.raises(BufferSpecError):
        loaded.put_batch(keys[3:5], [payload(3), data])
    assert_intact(loaded, keys, blocks)


@pytest.mark.parametrize(
    "out",
    [
        np.zeros(BLOCK - 1, np.uint8),
        np.zeros(2 * BLOCK, np.uint8)[::2],
        b"\0" * BLOCK,
        None,
    ],
    ids=["too-small", "strided", "bytes-readonly", "none"],
)
def test_bad_out_buffers(loaded: KVStore, keys: list[bytes], out: object) -> None:
    with pytest.raises(BufferSpecError):
        loaded.get_into(keys[0], out)
    with pytest.raises(BufferSpecError):
        loaded.get_into_batch(keys[:2], [np.zeros(BLOCK, np.uint8), out])
    assert_intact(loaded, keys)


def test_readonly_numpy_out(loaded: KVStore, keys: list[bytes]) -> None:
    out = np.zeros(BLOCK, np.uint8)
    out.setflags(write=False)
    with pytest.raises(BufferSpecError, match="read-only"):
        loaded.get_into(keys[0], out)
    assert not out.any()


def test_batch_lengths_must_match(loaded: KVStore, keys: list[bytes]) -> None:
    blocks = loaded.stats()["blocks"]
    with pytest.raises(ValueError, match="same length"):
        loaded.put_batch(keys[3:6], [payload(0)])
    with pytest.raises(ValueError, match="same length"):
        loaded.put_batch(keys[3:5], [payload(0), payload(1)], [None])
    with pytest.raises(ValueError, match="same length"):
        loaded.get_into_batch(keys[:2], [bytearray(BLOCK)])
    assert_intact(loaded, keys, blocks)


def test_block_larger_than_the_store(loaded: KVStore, keys: list[bytes], kind: str) -> None:
    """A documented difference: the embedded pool knows its tiers (BlockTooLargeError),
    the cluster's master refuses the allocation (PoolFullError)."""
    blocks = loaded.stats()["blocks"]
    huge = np.zeros(128 << 20, np.uint8)
    expected = PoolFullError if kind.startswith("cluster") else BlockTooLargeError
    with pytest.raises(expected):
        loaded.put(keys[3], huge)
    with pytest.raises(expected):
        loaded.reserve(keys[3], huge.size)
    assert_intact(loaded, keys, blocks)


# -- close ----------------------------------------------------------------------------


def test_use_after_close(new_store: Callable[[], KVStore], keys: list[bytes]) -> None:
    store = new_store()
    store.put(keys[0], b"x")
    writer = store.reserve(keys[1], BLOCK)
    assert writer is not None
    store.close()
    store.close()  # idempotent
    for call in (
        lambda: store.put(keys[2], b"x"),
        lambda: store.put_batch(keys[2:3], [b"x"]),
        lambda: store.reserve(keys[2], 10),
        lambda: store.get(keys[0]),
        lambda: store.get_into(keys[0], bytearray(1)),
        lambda: store.get_into_batch(keys[:1], [bytearray(1)]),
        lambda: store.exists(keys),
        lambda: store.prefix_match(keys),
        lambda: store.lease(keys),
        lambda: store.remove(keys[0]),
        lambda: writer.write(0, payload(0)),
        lambda: writer.commit(),
    ):
        with pytest.raises(PoolClosedError):
            call()
    writer.abort()  # harmless: the space went with the pool (or the master's TTL frees it)
