"""``runtime.sampling``: greedy at temperature 0, seeded draws, top-k and top-p filters."""

from __future__ import annotations

import pytest
import torch

from kvpool.serve.runtime.sampling import GREEDY, SamplingParams, sample, sample_batch

LOGITS = torch.tensor([3.0, 2.5, 2.0, 0.5, 0.0, -1.0])


def draws(p: SamplingParams, n: int = 300) -> list[int]:
    return [sample(LOGITS, p, i) for i in range(n)]


def test_greedy_and_degenerate_filters_are_argmax() -> None:
    assert sample(LOGITS, GREEDY, 0) == 0
    assert set(draws(SamplingParams(1.0, top_k=1, seed=3))) == {0}
    assert set(draws(SamplingParams(1.0, top_p=0.01, seed=3))) == {0}


def test_same_seed_and_index_same_token() -> None:
    p = SamplingParams(1.5, seed=42)
    assert draws(p) == draws(p)
    assert draws(p) != draws(SamplingParams(1.5, seed=43))


def test_top_k_and_top_p_bound_the_support() -> None:
    assert set(draws(SamplingParams(2.0, top_k=3, seed=1))) == {0, 1, 2}
    probs = torch.softmax(LOGITS, -1)  # cumulative 0.47, 0.76, 0.93, 0.97: 0.95 needs four
    assert probs[:3].sum() < 0.95 < probs[:4].sum()
    assert set(draws(SamplingParams(1.0, top_p=0.95, seed=1), 600)) == {0, 1, 2, 3}


def test_frequencies_follow_the_temperature_softmax() -> None:
    got = torch.bincount(torch.tensor(draws(SamplingParams(1.0, seed=5), 4000)), minlength=6)
    want = torch.softmax(LOGITS, -1) * 4000
    assert torch.all((got - want).abs() < 5 * want.sqrt() + 5)


def test_batch_rows_are_independent_of_the_batch() -> None:
    p = SamplingParams(1.0, seed=9)
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    assert sample_batch(rows, [p, GREEDY], [4, 0]) == [sample(LOGITS, p, 4), 5]


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}])
def test_bad_params(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)  # type: ignore[arg-type]
