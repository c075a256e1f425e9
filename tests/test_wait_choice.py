"""How small SSD writes choose between waiting awake and a synchronous write
(kvpool.storage.wait_choice): the exact order around a spin that ran out. A real
tier doing it: tests/test_ssd_aio.py."""

from __future__ import annotations

from kvpool.storage.wait_choice import BACKOFF_WRITES, WaitChoice


def test_awake_until_a_spin_runs_out_then_synchronous_for_a_while() -> None:
    choice = WaitChoice()
    assert [choice.awake(0) for _ in range(3)] == [True] * 3
    # a spin ran out (the writer's count moved to 1)
    assert [choice.awake(1) for _ in range(BACKOFF_WRITES)] == [False] * BACKOFF_WRITES
    assert choice.awake(1) and choice.awake(1)  # tried again
    assert not choice.awake(2)  # another one ran out
    # and another: the count restarts, it does not add to what was left
    taken = [choice.awake(3) for _ in range(BACKOFF_WRITES + 1)]
    assert taken == [False] * BACKOFF_WRITES + [True]
    assert (choice.awake_writes, choice.sync_writes) == (6, 2 * BACKOFF_WRITES + 1)
