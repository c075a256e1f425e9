"""Stamps and block tables for the tests of seals in shared memory (test_shm_seal,
test_node_commits): one-page blocks at page offsets, term 3 unless told."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.cluster.block_table import BlockTable
from kvpool.transport.fencing import FENCE_OK, WriteStamp
from kvpool.transport.shm_seal import SealRecords

PAGE = 4096
NO_KEY = bytes(16)
K1, K2, P1 = b"\x01" * 16, b"\x02" * 16, b"\x07" * 16


def table(seals: SealRecords, clock: Callable[[], int] | None = None, epoch: int = 3) -> BlockTable:
    """A node's block table over ``seals`` (``clock``: CLOCK_MONOTONIC ns), serving ``epoch``."""
    t = BlockTable(
        lambda offset, size: 1, claim_wait=0.2, seals=seals, **({"clock": clock} if clock else {})
    )
    t.new_term(epoch)
    return t


def ahead(alloc: int, offset: int = 0, epoch: int = 3) -> WriteStamp:
    """A claim taken ahead for a grant: placeholder key."""
    return WriteStamp(epoch, alloc, offset, PAGE, NO_KEY)


def real(alloc: int, offset: int = 0, epoch: int = 3, key: bytes = K1) -> WriteStamp:
    """The stamp its writer seals: the real key and a parent."""
    return WriteStamp(epoch, alloc, offset, PAGE, key, P1)


def sealed_by_tcp(t: BlockTable, *stamps: WriteStamp) -> None:
    """Each block claimed and sealed by a final TCP write, as the data server does."""
    for stamp in stamps:
        assert t.claim(stamp, owner="conn") == FENCE_OK
        assert t.finish(stamp, "conn", ok=True, seal=True) == FENCE_OK


class Link:
    """A master link that answers each commit with the next of ``answers``."""

    def __init__(self, *answers: Any) -> None:
        self.answers, self.calls = list(answers), []

    def call(self, method: str, request: Any) -> Any:
        self.calls.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
