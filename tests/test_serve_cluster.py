"""Prefill and decode in different processes, KV through the distributed pool.

A prefill worker process (``python -c``) prefills two prompts that share a
prefix against a real master + node; this test process then decodes both
from the pool. Tokens must equal the no-cache reference, and the second
prompt must have been prefilled only past the shared blocks.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import msgpack
import pytest
import torch
from clusterhelpers import Cluster, start_cluster, wait_until

import kvpool
from kvpool.serve.runtime.decode import DecodeEngine
from kvpool.serve.runtime.model import build_model, generate
from kvpool.serve.runtime.prefill import PrefillResult

torch.set_num_threads(1)
BT = 16

PREFILL_WORKER = textwrap.dedent(
    """
    import sys, msgpack, torch
    torch.set_num_threads(1)
    import kvpool
    from kvpool.serve.runtime.model import build_model
    from kvpool.serve.runtime.prefill import PrefillWorker
    prompts = msgpack.unpackb(sys.stdin.buffer.read())
    model = build_model("tiny", seed=0, block_tokens={bt})
    with kvpool.connect({url!r}) as pool, PrefillWorker(model, pool, chunk_tokens=24) as w:
        out = [w.prefill(p, request_id=f"r{{i}}").to_dict() for i, p in enumerate(prompts)]
    sys.stdout.buffer.write(msgpack.packb(out))
    """
)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster(["16MiB"])
    yield c
    c.stop()


def test_prefill_process_to_decode_process_through_the_pool(cluster: Cluster) -> None:
    g = torch.Generator().manual_seed(42)
    first = torch.randint(0, 256, (57,), generator=g).tolist()  # 3 blocks + 9
    second = first[:48] + torch.randint(0, 256, (13,), generator=g).tolist()  # 3 shared blocks
    done = subprocess.run(
        [sys.executable, "-c", PREFILL_WORKER.format(bt=BT, url=cluster.url)],
        input=msgpack.packb([first, second]),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    r1, r2 = (PrefillResult.from_dict(d) for d in msgpack.unpackb(done.stdout))
    assert (r1.cached_tokens, r1.computed_tokens, r1.stored_blocks) == (0, 57, 3)
    assert (r2.cached_tokens, r2.computed_tokens, r2.stored_blocks) == (48, 13, 0)

    model = build_model("tiny", seed=0, block_tokens=BT)
    with kvpool.connect(cluster.url, timeout=5) as pool:
        assert wait_until(lambda: len(pool.stats()["nodes"]) == 1, timeout=15)
        engine = DecodeEngine(model, pool, num_pages=32, page_tokens=8)
        reqs = [engine.submit(r1, 6), engine.submit(r2, 9)]
        engine.run()
        assert [r.recomputed_tokens for r in reqs] == [0, 0]  # all prompt KV came from the pool
        assert not any(pool.exists([r1.tail_key, r2.tail_key]))  # tails consumed
    assert reqs[0].output == generate(model, first, 6)
    assert reqs[1].output == generate(model, second, 9)
