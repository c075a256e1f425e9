"""Eviction policies: exact orders, and invariants checked on random op sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.eviction import (
    ONLINE_POLICIES,
    POLICIES,
    AdmitOnSecondSight,
    BeladyPolicy,
    EvictionPolicy,
    LeafPolicy,
    LeafS3Policy,
    LFUPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def drain(policy: EvictionPolicy) -> list[int]:
    out = []
    while (v := policy.victim()) is not None:
        out.append(int.from_bytes(v, "little"))
    return out


LEAF_AWARE = {"leaf", "leaf-s3"}


# -- registry -----------------------------------------------------------------


def test_registry_names_and_errors() -> None:
    for base in ("lru", "lfu", "s3fifo", "leaf", "leaf-s3"):
        assert base in ONLINE_POLICIES
        assert f"{base}+admit2" in ONLINE_POLICIES
    assert "belady" in POLICIES and "belady" not in ONLINE_POLICIES
    for name in ONLINE_POLICIES:
        p = make_policy(name)
        assert p.name == name and len(p) == 0
    assert isinstance(make_policy("leaf+admit2"), AdmitOnSecondSight)
    with pytest.raises(ValueError, match="known: lru"):
        make_policy("nope")
    with pytest.raises(ValueError, match="offline oracle"):
        make_policy("belady")
    assert isinstance(make_policy("belady", requests=[[k(1)]], capacity=1), BeladyPolicy)


# -- exact orders -------------------------------------------------------------


def test_lru_exact_order_and_pins() -> None:
    p = LRUPolicy()
    for i in range(5):
        p.on_insert(k(i))
    p.on_access(k(1))
    p.on_access(k(3))
    assert p.victim(lambda key: key != k(0)) == k(2)
    assert drain(p) == [0, 4, 1, 3]


def test_s3fifo_one_hit_wonders_leave_first() -> None:
    p = S3FIFOPolicy()
    for i in range(10):
        p.on_insert(k(i))
    for i in range(5):
        p.on_access(k(i))
    # The unaccessed keys leave first, in FIFO order; the hit ones moved to main.
    assert [int.from_bytes(p.victim() or b"", "little") for _ in range(5)] == [5, 6, 7, 8, 9]
    assert all(p.queue_of(k(i)) == "main" for i in range(5))
    assert p.queue_of(k(5)) == "ghost"
    # A ghost hit goes straight to main; a fresh key to small.
    p.on_insert(k(5))
    p.on_insert(k(20))
    assert p.queue_of(k(5)) == "main" and p.queue_of(k(20)) == "small"


def test_s3fifo_main_gives_second_chances() -> None:
    p = S3FIFOPolicy(small_ratio=0.5)
    for i in range(4):
        p.on_insert(k(i))
        p.on_access(k(i))
    # 0, 1, 2 were hit in small: they move to main until small is below half;
    # then main's oldest key (counter reset by the move) is evicted.
    assert p.victim() == k(0)
    assert [p.queue_of(k(i)) for i in range(4)] == [None, "main", "main", "small"]
    p.on_access(k(2))  # key 2 gets a second chance in main
    assert drain(p) == [1, 3, 2]


def test_lfu_keeps_frequent_key_and_ages() -> None:
    p = LFUPolicy(min_period=64, aging_factor=1.0)
    p.on_insert(k(0))
    for _ in range(10):
        p.on_access(k(0))
    evicted = []
    for i in range(1, 40):  # a stream of one-off keys through a 4-slot cache
        if len(p) >= 4:
            v = p.victim()
            assert v is not None
            evicted.append(v)
        p.on_insert(k(i))
    assert k(0) in p and k(0) not in evicted
    before = p.count(k(0))
    assert before is not None and before >= 8
    for _ in range(200):  # others' traffic ages key 0's count away
        p.on_access(k(39))
    after = p.count(k(0))
    assert after is not None and after < before
    # A key with an aged count of 0 leaves before a fresh key with count 1.
    q = LFUPolicy(min_period=4, aging_factor=1.0)
    q.on_insert(k(1))
    for _ in range(4):
        q.on_access(k(2)) if k(2) in q else q.on_insert(k(2))
    q.on_insert(k(3))
    assert q.count(k(1)) == 0 and q.victim() == k(1)


def test_leaf_evicts_tails_first_and_keeps_shared_roots() -> None:
    p = LeafPolicy()
    # root 0 shared by chains 0-1-2 and 0-3
    p.on_insert(k(0))
    p.on_insert(k(1), k(0))
    p.on_insert(k(2), k(1))
    p.on_insert(k(3), k(0))
    assert p.children(k(0)) == 2 and p.children(k(1)) == 1
    assert drain(p) == [2, 1, 3, 0]


def test_leaf_recency_among_leaves_and_pins() -> None:
    p = LeafPolicy()
    for i in range(3):
        p.on_insert(k(i))
    p.on_insert(k(10), k(0))
    p.on_access(k(1))
    # leaves: 1 (hit last), 2, 10; 0 has a child
    assert p.victim(lambda key: key != k(2)) == k(10)
    assert p.victim() == k(0)  # a leaf again, older than 2
    assert drain(p) == [2, 1]


def test_leaf_knows_children_inserted_before_their_parent() -> None:
    p = LeafPolicy()
    p.on_insert(k(2), k(1))  # orphan: its parent was not admitted
    p.on_insert(k(1), k(0))
    assert p.children(k(1)) == 1
    assert p.victim() == k(2)
    assert p.victim() == k(1)


def test_leaf_s3_filters_one_off_blocks() -> None:
    p = LeafS3Policy()
    # a conversation prefix 0-1-2 that was hit, then a long one-off document
    p.on_insert(k(0))
    p.on_insert(k(1), k(0))
    p.on_insert(k(2), k(1))
    for i in range(3):
        p.on_access(k(i))
    assert p.segment(k(2)) == "protected"
    p.on_insert(k(50), k(0))
    for i in range(51, 60):
        p.on_insert(k(i), k(i - 1))
    # probation is over 10%: the document unwinds from its tail
    assert [p.victim() for _ in range(10)] == [k(i) for i in range(59, 49, -1)]
    assert p.segment(k(50)) == "ghost"
    assert p.segment(k(55)) is None  # the ghost holds as many keys as protected
    p.on_insert(k(50), k(0))
    assert p.segment(k(50)) == "protected"
    assert drain(p) == [2, 1, 50, 0]  # least recently used leaf first


def test_admit_on_second_sight() -> None:
    p = AdmitOnSecondSight(LRUPolicy(), min_history=4)
    assert p.admit(k(1)) is False
    assert p.admit(k(1)) is True
    assert p.admit(k(1)) is False  # forgotten once admitted
    for i in range(2, 10):
        assert p.admit(k(i)) is False
    assert p.admit(k(2)) is False  # pushed out of the 4-key history
    assert p.admit(k(9)) is True
    p.on_insert(k(9))
    assert k(9) in p and len(p) == 1 and p.victim() == k(9)


def test_belady_furthest_next_use_with_bypass() -> None:
    reqs = [[k(1)], [k(2)], [k(3)], [k(1)], [k(2)]]
    p = BeladyPolicy(reqs, capacity=2)
    p.advance(0)
    assert p.admit(k(1))
    p.on_insert(k(1))
    p.advance(1)
    p.on_insert(k(2))
    p.advance(2)
    assert not p.admit(k(3))  # never used again
    p.advance(2)
    assert p.next_use(k(1)) == 3 and p.next_use(k(2)) == 4
    assert p.victim() == k(2)


# -- invariants on random op sequences ------------------------------------------

N_KEYS = 24
op = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, N_KEYS - 1), st.integers(-1, N_KEYS - 1)),
    st.tuples(st.just("access"), st.integers(0, N_KEYS - 1), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, N_KEYS - 1), st.just(0)),
    st.tuples(st.just("victim"), st.integers(0, 2**N_KEYS - 1), st.just(0)),
    st.tuples(st.just("admit"), st.integers(0, N_KEYS - 1), st.just(0)),
)


@pytest.mark.parametrize("name", ONLINE_POLICIES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=80))
def test_policy_invariants(name: str, ops: list[tuple[str, int, int]]) -> None:
    policy = make_policy(name)
    leaf_aware = name.split("+")[0] in LEAF_AWARE
    tracked: set[int] = set()
    parent_of: dict[int, int | None] = {}
    for kind, a, b in ops:
        if kind == "insert":
            if a in tracked:
                continue
            parent = b if 0 <= b < a else None  # acyclic, like chained keys
            policy.on_insert(k(a), None if parent is None else k(parent))
            tracked.add(a)
            parent_of[a] = parent
        elif kind == "access":
            policy.on_access(k(a))  # a no-op for untracked keys
        elif kind == "remove":
            policy.on_remove(k(a))
            tracked.discard(a)
        elif kind == "admit":
            assert isinstance(policy.admit(k(a)), bool)
        else:
            pinned = {i for i in range(N_KEYS) if a >> i & 1}
            v = policy.victim(
                lambda key, pinned=pinned: int.from_bytes(key, "little") not in pinned
            )
            kids = {p for c, p in parent_of.items() if c in tracked and p is not None}
            candidates = {i for i in tracked if i not in pinned}
            if leaf_aware:
                candidates -= kids
            if v is None:
                assert not candidates
            else:
                i = int.from_bytes(v, "little")
                assert i in candidates, (i, tracked, pinned)
                tracked.discard(i)
        assert len(policy) == len(tracked)
        for i in range(N_KEYS):
            assert (k(i) in policy) == (i in tracked)
    # Draining with nothing pinned empties the policy, leaves first where required.
    while tracked:
        v = policy.victim()
        assert v is not None
        i = int.from_bytes(v, "little")
        assert i in tracked
        if leaf_aware:
            assert not any(parent_of[c] == i for c in tracked)
        tracked.discard(i)
    assert len(policy) == 0 and policy.victim() is None
