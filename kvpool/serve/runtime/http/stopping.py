"""When a completion stops, and the text it may send: EOS, ``stop_token_ids``, ``stop`` strings.

One ``StopState`` per request, fed every generated token in order (the
prefill's first token included). It keeps the decoded text, cut at the first
``stop`` string (the string itself is not returned, as in OpenAI's API), and
``finish`` (``"stop"`` once EOS, a stop token or a stop string is seen). A
streamed answer holds back the last ``len(longest stop) - 1`` characters until
they can no longer begin a stop string, so a client never receives text that
a later token turns into a stop.

Text of EOS and of stop tokens is not included (their ids still are in
``token_ids``).
"""

from __future__ import annotations

from typing import Any

from kvpool.serve.runtime.tokenizer import TextTokenizer

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 64


def parse_stop(body: dict[str, Any], vocab: int) -> tuple[tuple[str, ...], frozenset[int]]:
    """``stop`` (a string or up to 4) and ``stop_token_ids`` of a request, or ValueError."""
    stop = body.get("stop")
    if stop is None:
        strings: tuple[str, ...] = ()
    elif isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
    else:
        raise ValueError("stop: must be a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS or any(not s for s in strings):
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
    ):
        raise ValueError(f"stop_token_ids: must be a list of token ids in [0, {vocab})")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
    return strings, frozenset(ids)


class StopState:
    """A request's decoded text and whether (and why) it has stopped."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        eos_id: int | None,
        stop: tuple[str, ...] = (),
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._decoder = tokenizer.decode_stream()
        self.eos_id = eos_id
        self.stop = stop
        self.stop_ids = stop_token_ids
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters already streamed
        self.finish: str | None = None

    def feed(self, token: int, last: bool = False) -> bool:
        """Add one generated token (``last``: the decoder will send no more). True once
        the request should stop (EOS, a stop token or a stop string)."""
        if self.finish is not None:
            return True
        if token == self.eos_id or token in self.stop_ids:
            self.text += self._decoder.flush()
            self.finish = "stop"
            return True
        start = max(0, len(self.text) - self.holdback)
        self.text += self._decoder.feed(token)
        if last:
            self.text += self._decoder.flush()
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish = "stop"
            return True
        return False

    def pending(self, finished: bool) -> str:
        """Text not streamed yet that can be sent now (all of it once ``finished``)."""
        end = len(self.text) if finished or self.finish else len(self.text) - self.holdback
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
