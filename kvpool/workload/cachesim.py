"""Trace-driven cache simulation: block prefix-hit ratio per policy and capacity.

Requests are replayed through the real index — each record becomes tokens
(``kvpool.workload.tokens.tokens_for_request``) and then chained block keys
(``kvpool.index.keys.block_keys``), so only full blocks count, exactly as
the pool keys them — and through the policies, with no data.

Hit ratio (block prefix-hit ratio): for each request, count its leading
blocks that are cached, stopping at the first miss; divide the sum over all
requests by the number of blocks of all requests. After each request, every
block of it is refreshed (``on_access``) if cached, or else offered for
insertion: if ``policy.admit(key)`` agrees, victims are evicted until there
is room and the block is inserted with ``on_insert(key, parent)``.

Also computed: the infinite-capacity ratio (every block ever seen stays) and
Belady's (offline furthest-next-use with bypass) at each capacity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvpool.eviction import ONLINE_POLICIES, BeladyPolicy, EvictionPolicy, make_policy
from kvpool.index.keys import Namespace, block_keys
from kvpool.workload.tokens import tokens_for_request
from kvpool.workload.traces import DEFAULT_BLOCK_TOKENS, TraceRecord

Keys = list[bytes]

SIM_NAMESPACE = Namespace(model="kvpool-cachesim")


def trace_keys(
    records: Iterable[TraceRecord],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    namespace: Namespace = SIM_NAMESPACE,
) -> list[Keys]:
    """The block keys of every request, through ``tokens_for_request`` + ``block_keys``."""
    return [
        block_keys(tokens_for_request(rec, block_tokens), namespace, block_tokens)
        for rec in records
    ]


def simulate(requests: Sequence[Keys], policy: EvictionPolicy, capacity: int) -> tuple[int, int]:
    """Replay ``requests`` through ``policy`` with room for ``capacity`` blocks.

    Returns (prefix-hit blocks, total blocks). A ``BeladyPolicy`` is told
    which request is being served.
    """
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    oracle = policy if isinstance(policy, BeladyPolicy) else None
    hits = total = 0
    contains = policy.__contains__
    on_access = policy.on_access
    for i, keys in enumerate(requests):
        if oracle is not None:
            oracle.advance(i)
        total += len(keys)
        n = 0
        for key in keys:
            if not contains(key):
                break
            n += 1
        hits += n
        # Refresh the cached prefix (resident: it was just matched), then the
        # rest: refresh what is cached, offer the others for insertion.
        for key in keys[:n]:
            on_access(key)
        parent = keys[n - 1] if n else None
        for key in keys[n:]:
            if contains(key):
                on_access(key)
            elif capacity > 0 and policy.admit(key):
                m = len(policy)
                while m >= capacity and policy.victim() is not None:
                    m -= 1  # a victim is untracked (the interface's invariant)
                if m < capacity:
                    policy.on_insert(key, parent)
            parent = key
    return hits, total


def infinite_hits(requests: Sequence[Keys]) -> tuple[int, int]:
    """(prefix-hit blocks, total blocks) with unbounded capacity."""
    seen: set[bytes] = set()
    hits = total = 0
    for keys in requests:
        total += len(keys)
        for key in keys:
            if key not in seen:
                break
            hits += 1
        seen.update(keys)
    return hits, total


def _ratio(hits: int, total: int) -> float:
    return hits / total if total else 0.0


def run_cachesim(
    requests: Sequence[Keys],
    capacities: Sequence[int],
    policies: Sequence[str] = ONLINE_POLICIES,
    belady: bool = True,
) -> list[dict[str, Any]]:
    """Rows ``{policy, capacity_blocks, hit_ratio}``: every policy at every
    capacity, then ``belady`` at every capacity, then one ``infinite`` row
    (``capacity_blocks`` null)."""
    rows: list[dict[str, Any]] = []
    for name in policies:
        for cap in capacities:
            hits, total = simulate(requests, make_policy(name), cap)
            rows.append({"policy": name, "capacity_blocks": cap, "hit_ratio": _ratio(hits, total)})
    if belady:
        for cap in capacities:
            oracle = BeladyPolicy(requests, capacity=cap)
            hits, total = simulate(requests, oracle, cap)
            rows.append(
                {"policy": "belady", "capacity_blocks": cap, "hit_ratio": _ratio(hits, total)}
            )
    hits, total = infinite_hits(requests)
    rows.append({"policy": "infinite", "capacity_blocks": None, "hit_ratio": _ratio(hits, total)})
    return rows
