"""WriteHolders: which connection holds which block's writes in flight, on the node.

A hypothesis state machine holds, releases, seals and drops writes of a few
entries by a few owners (connections) and checks after every step, against a
plain count per (owner, entry): each entry's ``inflight``, what ``holder``
answers, and that the per-entry index names exactly the holders (``check``);
plus the exact cases a TCP put with its grant's claim taken ahead goes through.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.cluster.block_entry import CLAIMED, Entry
from kvpool.cluster.write_holders import WriteHolders
from kvpool.transport.fencing import WriteStamp

OWNERS = ("conn-a", "conn-b", "conn-c")


def entry(n: int) -> Entry:
    return Entry(WriteStamp(1, n + 1, n * 4096, 4096, bytes(16)), CLAIMED)


def test_a_seal_ends_the_claim_taken_ahead_and_the_write_on_two_connections() -> None:
    holders = WriteHolders()
    e, other = entry(0), entry(1)
    holders.hold(e, "claims")  # the claim taken ahead, on one pooled connection
    holders.hold(other, "bystander")  # another connection's write elsewhere
    assert holders.holder(e, "write") == "claims"  # a release on another connection finds it
    holders.hold(e, "write")  # the put's write claims the range it holds already
    assert e.inflight == 2
    holders.sealed(e)
    assert e.inflight == 0 and other.inflight == 1
    assert holders.holder(e, "write") == "write"  # nobody holds it: the asker itself
    assert not holders.release(e, "claims")  # the late release of the claim: nothing held
    assert holders.gone("bystander") == [other] and other.inflight == 0
    holders.check()


def test_a_connection_that_goes_away_ends_only_its_own_holds() -> None:
    holders = WriteHolders()
    e = entry(0)
    holders.hold(e, "a")
    holders.hold(e, "a")
    holders.hold(e, "b")
    assert holders.gone("a") == [e] and e.inflight == 1
    assert holders.holder(e, "a") == "b"
    assert holders.release(e, "b") and e.inflight == 0
    holders.check()


class HoldersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.holders = WriteHolders()
        self.entries = [entry(n) for n in range(3)]
        self.model: Counter[tuple[str, int]] = Counter()  # (owner, entry index) -> writes held

    @rule(e=st.integers(0, 2), owner=st.sampled_from(OWNERS))
    def hold(self, e: int, owner: str) -> None:
        self.holders.hold(self.entries[e], owner)
        self.model[(owner, e)] += 1

    @rule(e=st.integers(0, 2), owner=st.sampled_from(OWNERS))
    def release(self, e: int, owner: str) -> None:
        held = self.model[(owner, e)] > 0
        assert self.holders.release(self.entries[e], owner) == held
        if held:
            self.model[(owner, e)] -= 1

    @rule(owner=st.sampled_from(OWNERS))
    def gone(self, owner: str) -> None:
        ended = {id(x) for x in self.holders.gone(owner)}
        expected = {id(self.entries[e]) for (o, e), n in self.model.items() if o == owner and n}
        assert ended == expected
        for key in [k for k in self.model if k[0] == owner]:
            del self.model[key]

    @rule(e=st.integers(0, 2))
    def sealed(self, e: int) -> None:
        self.holders.sealed(self.entries[e])
        for key in [k for k in self.model if k[1] == e]:
            del self.model[key]

    @rule(e=st.integers(0, 2), owner=st.sampled_from(OWNERS))
    def holder(self, e: int, owner: str) -> None:
        found = self.holders.holder(self.entries[e], owner)
        holding = {o for (o, i), n in self.model.items() if i == e and n}
        assert found == owner if owner in holding or not holding else found in holding

    @invariant()
    def counts_agree(self) -> None:
        for i, e in enumerate(self.entries):
            assert e.inflight == sum(n for (_, j), n in self.model.items() if j == i)
        self.holders.check()


TestHolders = HoldersMachine.TestCase
TestHolders.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
