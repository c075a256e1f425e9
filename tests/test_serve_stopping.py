"""``StopState``: stop strings across token boundaries, held-back streaming, stop ids."""

from __future__ import annotations

import pytest

from kvpool.serve.runtime.http.stopping import StopState, parse_stop
from kvpool.serve.runtime.tokenizer import EOS, ByteTokenizer

TOK = ByteTokenizer()


def run(text: str, stop: tuple[str, ...], ids: frozenset[int] = frozenset()) -> tuple[str, str]:
    s = StopState(TOK, EOS, stop, ids)
    streamed = ""
    tokens = TOK.encode(text, add_bos=False)
    for i, t in enumerate(tokens):
        done = s.feed(t, last=i == len(tokens) - 1)
        streamed += s.pending(done or i == len(tokens) - 1)
        if done:
            break
    return streamed, s.text


def test_stop_string_split_over_tokens_is_never_streamed() -> None:
    streamed, text = run("hello wor|ld END more", ("END", "xyz"))
    assert streamed == text == "hello wor|ld "


def test_no_stop_streams_everything_and_finishes_by_length() -> None:
    s = StopState(TOK, EOS, ("zz",))
    out = "".join(s.pending(False) for t in TOK.encode("abcdef", add_bos=False) if not s.feed(t))
    assert out + s.pending(True) == "abcdef" and s.finish is None


def test_multibyte_characters_and_stop_ids() -> None:
    streamed, text = run("Grüße!", (), frozenset({ord("e")}))
    assert streamed == text == "Grüß"
    s = StopState(TOK, EOS)
    assert s.feed(EOS) and s.finish == "stop" and s.text == ""


@pytest.mark.parametrize(
    "body",
    [
        {"stop": ""},
        {"stop": ["a"] * 5},
        {"stop": [1]},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": "x"},
    ],
)
def test_bad_stop_parameters(body: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="stop"):
        parse_stop(body, 260)
