"""Byte-level tokenizer: every UTF-8 byte is a token.

Ids:

| id | meaning |
|---|---|
| 0-255 | the byte with that value |
| 256 (``BOS``) | beginning of sequence; ``encode`` prepends it unless ``add_bos=False`` |
| 257 (``EOS``) | end of sequence; pass it as ``eos_id`` to stop generation |
| 258 (``PAD``) | padding; never produced by ``encode`` |
| 259 (``UNK``) | reserved |

``vocab_size`` is 260 (the ``tiny`` preset's vocabulary). ``decode`` drops
special ids and any id outside the byte range (the LLaMA-shaped presets have
a 32000-token vocabulary), and replaces invalid UTF-8 with U+FFFD, so it
never fails on model output.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Protocol


class TextStream(Protocol):
    def feed(self, token: int) -> str: ...
    def flush(self) -> str: ...


class TextTokenizer(Protocol):
    """What the front end needs of a tokenizer (``ByteTokenizer``, ``HFTokenizer``)."""

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def decode_stream(self) -> TextStream: ...


BOS = 256
EOS = 257
PAD = 258
UNK = 259
VOCAB_SIZE = 260
SPECIAL_IDS = {"bos": BOS, "eos": EOS, "pad": PAD, "unk": UNK}


class ByteTokenizer:
    bos_id = BOS
    eos_id = EOS
    pad_id = PAD
    unk_id = UNK
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in (int(t) for t in ids) if 0 <= i < 256).decode(
            "utf-8", errors="replace"
        )

    def decode_stream(self) -> StreamDecoder:
        """An incremental decoder for token-by-token streaming (holds split UTF-8)."""
        return StreamDecoder()


class StreamDecoder:
    """Feed ids one at a time; get text as soon as it forms complete characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if not 0 <= token < 256:
            return ""
        return str(self._decoder.decode(bytes([token])))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))
