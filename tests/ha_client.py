"""A client process for the HA storm test: ``python ha_client.py URL ROLE ID SECONDS [MODE]``.

ROLE ``writer``: puts block ``ID-i`` every 40 ms, each a new key, so a put
answering False (claiming the key is stored already) is an error; MODE
``replicas`` (the default) puts two replicas (the client commits them),
``node-commits`` one (its node commits it: writer 0 over TCP, ``WRITE_COMMIT``;
writer 1 on the same host, sealed in shared memory), ``mixed`` two replicas
with writer 0 and reader 0 over TCP, the others on the same host. ``reader``:
gets random blocks of writers 0 and 1 and checks their bytes. Prints one JSON object at the
end: what was acknowledged, completion times (``time.monotonic``, system-wide on
Linux), errors, wrong reads, and how many puts their node committed.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

import kvpool

BLOCK = 64 << 10


def key_of(writer: int, i: int) -> bytes:
    return (b"w%d-%06d" % (writer, i)).ljust(16, b"\0")


def payload(writer: int, i: int) -> np.ndarray:
    return np.random.default_rng(writer * 1_000_000 + i).integers(0, 256, BLOCK, dtype=np.uint8)


def main(url: str, role: str, ident: int, seconds: float, mode: str = "replicas") -> None:
    end = time.monotonic() + seconds
    report: dict[str, list] = {"acked": [], "done": [], "errors": [], "wrong": []}
    out = np.empty(BLOCK, np.uint8)
    rng = random.Random(ident)  # the same reads every run
    replicas = 1 if mode == "node-commits" else 2
    tcp = (mode, role, ident) == ("node-commits", "writer", 0) or (mode, ident) == ("mixed", 0)
    transport = "tcp" if tcp else None
    with kvpool.connect(url, timeout=5, transport=transport) as pool:
        i = 0
        while time.monotonic() < end:
            try:
                if role == "writer":
                    # Fresh keys: False would claim a block is stored already.
                    if not pool.put(key_of(ident, i), payload(ident, i), replicas=replicas):
                        raise AssertionError(f"put of new key {i} answered False")
                    report["acked"].append(i)
                    report["done"].append(time.monotonic())
                    i += 1
                else:
                    w, j = rng.randrange(2), rng.randrange(max(1, i))
                    if pool.get_into(key_of(w, j), out) == BLOCK:
                        if not np.array_equal(out, payload(w, j)):
                            report["wrong"].append([w, j])
                        report["done"].append(time.monotonic())
                    i += 1
            except Exception as exc:
                report["errors"].append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.04)
        report["by_node"] = [pool._putter.commits.by_node.count]
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:])
