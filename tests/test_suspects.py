"""Suspects: the nodes a client saw fail, avoided in its allocations for SUSPECT_S."""

from __future__ import annotations

from kvpool.cluster.client.suspects import RETRY_S, SUSPECT_S, Suspects


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_node_is_avoided_until_its_last_failure_is_old() -> None:
    clock = Clock()
    suspects = Suspects(clock=clock)
    assert suspects.current() == []
    suspects.report("b")
    suspects.report("a")
    assert suspects.current() == ["a", "b"]
    clock.now += SUSPECT_S - 1
    suspects.report("b")  # failed again: avoided for SUSPECT_S from now
    clock.now += 1
    assert suspects.current() == ["b"]  # a's suspicion ended
    clock.now += SUSPECT_S - 1.5  # 0.5 s before b's suspicion ends
    assert suspects.current() == ["b"]
    clock.now += 0.5
    assert suspects.current() == []


def test_a_suspected_node_gets_one_read_try_a_second_until_a_read_clears_it() -> None:
    """A read's failure counts as the node's try: reads in the next RETRY_S skip
    it; then one read tries it (the others keep skipping); a read that succeeds
    there clears the suspicion, for reads and allocations both."""
    clock = Clock()
    suspects = Suspects(clock=clock)
    assert suspects.may_read("a") and suspects.may_read("a")  # nothing suspected
    suspects.report("a", by_read=True)
    assert not suspects.may_read("a") and suspects.may_read("b")
    clock.now += RETRY_S - 0.01
    assert not suspects.may_read("a")
    clock.now += 0.01
    assert suspects.may_read("a")  # the one try of this second
    assert not suspects.may_read("a")  # the others skip it
    suspects.report("a", by_read=True)  # that try failed too
    clock.now += RETRY_S
    assert suspects.may_read("a")
    suspects.cleared("a")  # it served
    assert suspects.may_read("a") and suspects.may_read("a") and suspects.current() == []
    suspects.cleared("z")  # never suspected: nothing to do


def test_a_suspicion_that_ended_lets_every_read_try_again() -> None:
    clock = Clock()
    suspects = Suspects(clock=clock)
    suspects.report("a")
    clock.now += SUSPECT_S
    assert suspects.may_read("a") and suspects.may_read("a")
    assert suspects.current() == []


def test_a_write_failure_leaves_the_next_read_its_try() -> None:
    """A node a write saw fail is avoided by allocations at once, but a read has
    not tried it yet: the next read does (one), the others in that second skip."""
    clock = Clock()
    suspects = Suspects(clock=clock)
    suspects.report("a")
    assert suspects.current() == ["a"]
    assert suspects.may_read("a") and not suspects.may_read("a")
