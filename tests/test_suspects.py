"""Suspects: the nodes a client saw fail, avoided in its allocations for SUSPECT_S."""

from __future__ import annotations

from kvpool.cluster.client.suspects import SUSPECT_S, Suspects


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
