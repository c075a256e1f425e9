"""The streaming copy of large blocks (kvpool.bindings.stream_copy, issue 17).

The kernel: exact bytes for every length and misalignment around its 64-byte
lines, nothing written outside the destination, clear errors for bad buffers.
Its routing: below 64 KiB numpy's copy, from ``LEARN_BELOW`` streaming, in
between what each size class's first copies timed faster (the learning itself:
tests/test_copy_choice.py); ``$KVPOOL_STREAM_MIN`` fixes the bound instead and
``$KVPOOL_STREAM_COPY=0`` turns streaming off. End to end: blocks that cross the
bound, put by one process into a real node's shared arena (the copy, then the
seal record), read back exactly by another process, over shm and TCP.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from clusterhelpers import start_cluster, wait_until
from poolhelpers import make_keys, payload

import kvpool
from kvpool.bindings import copy_region, copy_region_out, stream_copy
from kvpool.bindings.copy_choice import initial_ways
from kvpool.transport import shm_copy

KERNEL = stream_copy.kernel_or_none()
if KERNEL is None and os.environ.get("KVPOOL_REQUIRE_STREAM_COPY") == "1":
    pytest.fail(f"KVPOOL_REQUIRE_STREAM_COPY=1 but {stream_copy.STATUS}", pytrace=False)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=stream_copy.STATUS)
GUARD = 128  # bytes checked untouched on each side of a destination


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@needs_kernel
@pytest.mark.parametrize("length", [0, 1, 31, 63, 64, 65, 127, 4096 + 17, 256 << 10, 1 << 20])
@pytest.mark.parametrize(("dst_shift", "src_shift"), [(0, 0), (1, 0), (0, 33), (63, 17)])
def test_the_kernel_copies_exactly_and_only_the_destination(
    length: int, dst_shift: int, src_shift: int
) -> None:
    assert KERNEL is not None
    src_base = _random(length + 64, seed=length)
    dst_base = np.full(length + 64 + 2 * GUARD, 0xA5, np.uint8)
    src = src_base[src_shift : src_shift + length]
    start = GUARD + dst_shift
    dst = dst_base[start : start + length]
    KERNEL(dst, src)
    assert np.array_equal(dst, src)
    assert (dst_base[:start] == 0xA5).all() and (dst_base[start + length :] == 0xA5).all()


@needs_kernel
def test_the_kernel_refuses_bad_buffers_and_copies_overlaps_as_memmove() -> None:
    assert KERNEL is not None
    src = _random(1 << 20, seed=1)
    with pytest.raises(ValueError, match="dst is 1048575 bytes, src 1048576"):
        KERNEL(np.empty((1 << 20) - 1, np.uint8), src)
    big = np.empty(stream_copy.LEARN_BELOW, np.uint8)  # always streamed: the same refusal
    with pytest.raises(ValueError, match=f"dst is {big.nbytes - 1} bytes, src {big.nbytes}"):
        stream_copy.copy_into(np.empty(big.nbytes - 1, np.uint8), big)
    with pytest.raises(ValueError):  # a learning size: the kernel's refusal, or numpy's
        stream_copy.copy_into(np.empty((1 << 20) - 1, np.uint8), src)
    readonly = np.empty(1 << 20, np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):  # numpy's refusal to export it
        KERNEL(readonly, src)
    with pytest.raises(ValueError, match="not C-contiguous"):  # not one range of bytes
        KERNEL(np.empty(2 << 20, np.uint8)[::2], src)
    with pytest.raises(TypeError, match="exactly two buffers"):
        KERNEL(src)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        KERNEL(np.empty(4, np.uint8), "four")
    both = _random(3 << 20, seed=2)
    want = both[: 2 << 20].copy()
    KERNEL(both[1 << 20 :], both[: 2 << 20])  # overlapping: memmove's result
    assert np.array_equal(both[1 << 20 :], want)


@needs_kernel
@pytest.mark.parametrize("stream_from", [stream_copy.STREAM_MIN, 1 << 20])
def test_with_a_fixed_bound_blocks_from_it_stream_and_smaller_ones_are_numpys(
    monkeypatch: pytest.MonkeyPatch, stream_from: int
) -> None:
    """``$KVPOOL_STREAM_MIN``'s routing (the table it builds, put in place here)."""
    calls: list[int] = []

    def spy(dst: np.ndarray, src: np.ndarray) -> None:
        calls.append(src.nbytes)
        assert KERNEL is not None
        KERNEL(dst, src)

    monkeypatch.setattr(stream_copy, "_kernel", spy)
    monkeypatch.setattr(stream_copy, "_into_ways", initial_ways(True, stream_from))
    monkeypatch.setattr(stream_copy, "_out_ways", initial_ways(True, stream_from))
    for n in (stream_from - 1, stream_from, 3 << 20):
        src = _random(n, seed=n)
        for copy in (stream_copy.copy_into, stream_copy.copy_out):
            dst = np.zeros(n, np.uint8)
            copy(dst, src)
            assert np.array_equal(dst, src)
        assert stream_copy.copies_plainly(n) == (n < stream_from)
        for region_copy in (copy_region, copy_region_out):  # into the start of a larger one
            big = np.zeros(n + 100, np.uint8)
            region_copy(big, src)
            assert np.array_equal(big[:n], src) and not big[n:].any()
    assert calls == [stream_from] * 4 + [3 << 20] * 4


def _learning_process(script: str) -> list[str]:
    """The lines ``script`` prints, run in a fresh process where size classes learn
    (``$KVPOOL_STREAM_MIN`` unset)."""
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_STREAM_MIN"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split("\n")


@needs_kernel
def test_by_default_the_middle_sizes_learn_and_every_copy_is_exact() -> None:
    """In a fresh process: below 64 KiB numpy's copy, from ``LEARN_BELOW`` streaming,
    in between each size class times its first copies both ways and settles, puts'
    copies and reads' apart; every copy on the way, timed or not, is exact, and the
    status line says what settled."""
    script = textwrap.dedent(
        """
        import numpy as np
        from kvpool.bindings import stream_copy as sc
        from kvpool.bindings.copy_choice import TRIALS
        assert sc.STREAM_FROM is None
        assert sc.copies_plainly(sc.STREAM_MIN - 1)
        assert not sc.copies_plainly(sc.STREAM_MIN) and not sc.copies_plainly(sc.LEARN_BELOW)
        rng = np.random.default_rng(5)
        for i in range(2 * TRIALS):
            n = sc.STREAM_MIN + 64 * i + i % 7  # one class, odd lengths
            src = rng.integers(0, 256, n, dtype=np.uint8)
            dst = np.zeros(n, np.uint8)
            sc.copy_into(dst, src)
            assert (dst == src).all(), i
            if i < TRIALS:  # reads learn on their own: half as many, still learning
                back = np.zeros(n, np.uint8)
                sc.copy_out(back, dst)
                assert (back == src).all(), i
        print(sc.copies_plainly(sc.STREAM_MIN))
        print(sc.status())
        """
    )
    plain, status = _learning_process(script)
    settled = "numpy copy" if plain == "True" else "streaming"
    puts, reads = status.split(" (puts: ")[1].split("; reads: ")
    assert puts.startswith(f"64KiB: {settled} (streaming ")
    assert "; 128KiB: learning;" in puts and puts.endswith("16MiB: learning")
    assert reads.startswith("64KiB: learning; 128KiB: learning;") and reads.endswith(")")
    assert status.startswith("streaming stores (")
    assert (
        ") from 32MiB; from 64KiB, per size class, whichever of it and numpy's copy its " in status
    )


@needs_kernel
def test_a_level_tie_goes_to_streaming_for_puts_and_to_numpy_for_reads() -> None:
    """In a fresh process whose clock times every copy alike (a level tie), the
    puts' learner settles on streaming and the reads' on numpy's copy."""
    script = textwrap.dedent(
        """
        import itertools, time
        ticks = itertools.count(0, 1000)
        time.perf_counter_ns = lambda: next(ticks)  # every timed copy: 1000 ns
        import numpy as np
        from kvpool.bindings import stream_copy as sc
        from kvpool.bindings.copy_choice import TRIALS
        src = np.arange(sc.STREAM_MIN, dtype=np.uint32).astype(np.uint8)
        for _ in range(2 * TRIALS):
            dst, back = np.zeros_like(src), np.zeros_like(src)
            sc.copy_into(dst, src)
            sc.copy_out(back, dst)
            assert (back == src).all()
        print(sc.copies_plainly(sc.STREAM_MIN))
        print(sc.learned())
        """
    )
    plain, learned = _learning_process(script)
    assert plain == "False"  # puts of the class stream
    puts, reads = learned.split("; reads: ")
    assert puts.startswith("puts: 64KiB: streaming (streaming 1.00x)")
    assert reads.startswith("64KiB: numpy copy (streaming 1.00x)")


SHOW_STATUS = textwrap.dedent(
    """
    import numpy as np
    from kvpool.bindings import stream_copy
    src = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
    dst = np.zeros_like(src)
    stream_copy.copy_into(dst, src)
    assert (dst == src).all()
    print(stream_copy.STREAM_FROM, stream_copy.status())
    """
)


def _run_with(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SHOW_STATUS],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_kernel
def test_the_environment_fixes_where_streaming_starts() -> None:
    out = _run_with({"KVPOOL_STREAM_MIN": str(1 << 20)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 1)[0] == str(1 << 20)
    assert out.stdout.strip().endswith("from 1MiB ($KVPOOL_STREAM_MIN)")  # nothing learned
    default = _run_with({"KVPOOL_STREAM_MIN": str(stream_copy.STREAM_MIN)})
    assert default.returncode == 0, default.stderr
    assert default.stdout.split(" ", 1)[0] == str(stream_copy.STREAM_MIN)
    assert default.stdout.strip().endswith("from 64KiB ($KVPOOL_STREAM_MIN)")


@pytest.mark.parametrize("bad", ["65535", "100000", "0", "-1", "1MiB", ""])
def test_a_bad_stream_min_is_refused_at_import_with_the_rule(bad: str) -> None:
    out = _run_with({"KVPOOL_STREAM_MIN": bad})
    assert out.returncode != 0
    assert (
        f"$KVPOOL_STREAM_MIN must be a power of two >= {stream_copy.STREAM_MIN} (bytes: the "
        f"smallest copy that streams), not {bad!r}"
    ) in out.stderr


def test_the_switch_turns_streaming_off_and_copies_stay_exact() -> None:
    script = textwrap.dedent(
        """
        import numpy as np
        from kvpool.bindings import stream_copy
        src = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
        dst = np.zeros_like(src)
        stream_copy.copy_into(dst, src)
        assert (dst == src).all() and stream_copy.kernel_or_none() is None
        print(stream_copy.status())
        """
    )
    env = {**os.environ, "KVPOOL_STREAM_COPY": "0"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "numpy copy ($KVPOOL_STREAM_COPY=0)"


# Sizes on both sides of STREAM_MIN, odd ones included (a tail after the last line).
SIZES = [stream_copy.STREAM_MIN - 1, stream_copy.STREAM_MIN + 3, 1 << 20, (3 << 20) + 100]
READER = """
import hashlib, sys
import numpy as np
import kvpool
url, transport, sizes, keys = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
with kvpool.connect(url, transport=transport) as pool:
    for size, key in zip(map(int, sizes.split(",")), keys.split(",")):
        out = np.zeros(size, np.uint8)
        assert pool.get_into(bytes.fromhex(key), out) == size
        print(hashlib.sha256(out).hexdigest())
    assert pool.stats()["transport"] == transport
"""


def _digests(blocks: list[np.ndarray]) -> list[str]:
    return [hashlib.sha256(b).hexdigest() for b in blocks]


def test_large_same_host_puts_are_read_back_exactly_by_another_process() -> None:
    cluster = start_cluster(["64MiB"])
    try:
        keys = make_keys(len(SIZES), seed=41)
        blocks = [payload(i + 1, size) for i, size in enumerate(SIZES)]
        with kvpool.connect(cluster.url, transport="shm") as pool:
            assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
            assert pool.put(keys[0], blocks[0]) and pool.put(keys[1], blocks[1])
            assert all(pool.put_batch(keys[2:], blocks[2:]))
            stats = pool.stats()
            assert stats["transport"] == "shm"
            assert stats["transports"]["shm"]["copy"] == stream_copy.status()
            assert stats["transports"]["shm"]["checked_copy"] == shm_copy.STATUS
            pool.flush()
            for key, block in zip(keys, blocks, strict=True):  # this process, shm
                out = np.zeros(block.nbytes, np.uint8)
                assert pool.get_into(key, out) == block.nbytes
                assert np.array_equal(out, block)
        args = [",".join(map(str, SIZES)), ",".join(k.hex() for k in keys)]
        for transport in ("shm", "tcp"):
            read = subprocess.run(
                [sys.executable, "-c", READER, cluster.url, transport, *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert read.returncode == 0, read.stderr
            assert read.stdout.split() == _digests(blocks), transport
    finally:
        cluster.stop()


def test_large_embedded_puts_and_reads_are_exact() -> None:
    blocks = [payload(i + 7, size) for i, size in enumerate(SIZES)]
    keys = make_keys(len(SIZES), seed=43)
    with kvpool.Pool.embedded(dram_bytes=32 << 20) as pool:
        assert pool.stats()["tiers"]["dram"]["copy"] == stream_copy.status()
        for key, block in zip(keys, blocks, strict=True):
            assert pool.put(key, block)
        for key, block in zip(keys, blocks, strict=True):
            out = np.zeros(block.nbytes + 5, np.uint8)  # a larger buffer: the first bytes
            assert pool.get_into(key, out) == block.nbytes
            assert np.array_equal(out[: block.nbytes], block) and not out[block.nbytes :].any()
