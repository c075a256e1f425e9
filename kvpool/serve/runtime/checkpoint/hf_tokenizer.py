"""A checkpoint's tokenizer (``tokenizer.json`` through the ``tokenizers`` library).

``encode`` applies the tokenizer's own post-processor (which adds BOS where
the checkpoint's tokenizer does, exactly as ``transformers``' fast tokenizer
does); ``decode`` skips special tokens. Same interface as ``ByteTokenizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvpool.serve.runtime.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from kvpool.serve.runtime.checkpoint.config import Checkpoint

TOKENIZER_FILE = "tokenizer.json"


def _load(ckpt: Checkpoint) -> Any:
    from tokenizers import Tokenizer

    path = ckpt.path / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (a fast tokenizer's tokenizer.json is needed)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable tokenizer: {exc}") from None


def check_tokenizer(ckpt: Checkpoint) -> None:
    """The tokenizer loads and every id it can produce has an embedding row."""
    vocab = _load(ckpt).get_vocab(with_added_tokens=True)
    top = max(vocab.values(), default=-1)
    if top >= ckpt.model.vocab_size:
        raise CheckpointError(
            f"tokenizer.json has token id {top} but config.json's vocab_size is "
            f"{ckpt.model.vocab_size}: the tokenizer does not belong to these weights"
        )


class HFTokenizer:
    """``tokenizers.Tokenizer`` with the checkpoint's BOS and EOS ids."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self._tok = _load(ckpt)
        self.bos_id = ckpt.bos_id
        self.eos_id = ckpt.eos_id
        self.vocab_size = ckpt.model.vocab_size

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_bos).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def decode_stream(self) -> HFStreamDecoder:
        return HFStreamDecoder(self)


class HFStreamDecoder:
    """Incremental decoding: text is released once it no longer ends in a partial character."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._sent = 0

    def feed(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character split across tokens: wait for the rest
        out, self._sent = text[self._sent :], len(text)
        return out

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        out, self._sent = text[self._sent :], len(text)
        return out
