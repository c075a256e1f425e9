"""Choosing the next token: greedy, or seeded sampling with temperature, top-k and top-p.

Determinism: the token at output index ``i`` of a request is drawn with its
own CPU generator seeded ``xxh3(seed, i)``, so the same seed gives the same
tokens wherever the token is chosen (the prefill worker picks index 0, a
pipeline's last stage likewise, the decode worker the rest) and however the
decode batch is composed. ``temperature == 0`` is greedy (argmax), exactly
as before sampling existed.

Order of the filters, as in vLLM and ``transformers``: logits / temperature,
then top-k, then top-p (the smallest set of most likely tokens whose
probability reaches ``top_p``), then a draw from the renormalised softmax.

Log-probabilities (``logprobs``: how many alternatives to report, None: off)
are the model's: ``log_softmax`` of the raw float32 logits the sampler was
given, before temperature, top-k and top-p (as OpenAI reports them), so they
do not depend on the sampling parameters. ``token_logprobs`` gives the
sampled token's and the ``k`` most likely tokens' values as plain data for
the workers' token events.

``n`` completions of one request: choice ``i`` samples with
``for_choice(i)``'s seed (choice 0 keeps the request's own seed, so ``n=1``
and choice 0 of ``n>1`` draw the same tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import xxhash
from torch import Tensor

#: The most alternatives a request may ask for per token (vLLM's default cap too).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    logprobs: int | None = None  # alternatives to report per token (None: no logprobs)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), not {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], not {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of an ``n > 1`` request (its own seed)."""
        if index == 0:
            return self
        key = xxhash.xxh3_64_intdigest(f"kvpool-choice/{self.seed}/{index}".encode())
        return replace(self, seed=key & ((1 << 63) - 1))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        return cls(**d) if d else GREEDY


GREEDY = SamplingParams()
#: A token's log-probability and the top alternatives: ``[logprob, [[id, logprob], ...]]``.
TokenLogprobs = tuple[float, list[tuple[int, float]]]


def _generator(seed: int, index: int) -> torch.Generator:
    key = xxhash.xxh3_64_intdigest(f"kvpool-sample/{seed}/{index}".encode())
    return torch.Generator().manual_seed(key & ((1 << 63) - 1))


def sample(logits: Tensor, params: SamplingParams, index: int) -> int:
    """The token for output index ``index`` from float logits ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.detach().float().cpu() / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        order = torch.argsort(x, descending=True)
        probs = torch.softmax(x[order], -1)
        before = torch.cumsum(probs, -1) - probs  # mass of the more likely tokens
        drop = order[before >= params.top_p]
        x[drop] = float("-inf")
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs, 1, generator=_generator(params.seed, index)))


def sample_batch(
    logits: Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
) -> list[int]:
    """``sample`` per row of ``logits [B, vocab]`` (greedy rows in one argmax)."""
    tokens: list[int] = torch.argmax(logits, dim=-1).tolist()
    for row, (p, i) in enumerate(zip(params, indices, strict=True)):
        if not p.greedy:
            tokens[row] = sample(logits[row], p, i)
    return tokens


def token_logprobs(logits: Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits [vocab]`` and the ``k`` most likely
    tokens' (most likely first): ``log_softmax`` of the raw logits in float32."""
    lp = torch.log_softmax(logits.detach().float(), -1)
    top = torch.topk(lp, k) if k > 0 else None
    alts = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return float(lp[token]), alts


def batch_logprobs(
    logits: Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """``token_logprobs`` per row of ``logits [B, vocab]`` that asked for them (else None)."""
    return [
        None if p.logprobs is None else token_logprobs(logits[row], t, p.logprobs)
        for row, (t, p) in enumerate(zip(tokens, params, strict=True))
    ]
