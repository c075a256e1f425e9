"""A checkpoint's chat template (jinja2), rendered as ``transformers``' ``apply_chat_template``.

The template comes from ``chat_template.jinja`` or ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of named templates: ``default`` is
used). It is rendered in jinja2's sandbox with ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception`` and ``strftime_now`` available, and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables,
as ``transformers`` does; the text it renders is tokenized without adding
special tokens (the template writes them).
"""

from __future__ import annotations

import json
import pathlib
from datetime import datetime
from typing import Any

from kvpool.serve.runtime.checkpoint.errors import CheckpointError

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (its ``raise_exception``) or failed to render."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """One checkpoint's chat template, compiled once."""

    def __init__(self, source: str, specials: dict[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise CheckpointError(f"the chat template does not compile: {exc}") from None
        self._specials = specials

    @classmethod
    def load(cls, path: pathlib.Path) -> ChatTemplate | None:
        """The template of checkpoint directory ``path``, or None when it has none."""
        cfg_path = path / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {exc}") from None
        source: Any = None
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        else:
            source = cfg.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str):
            return None
        specials = {k: t for k in SPECIAL if (t := _token_text(cfg.get(k))) is not None}
        return cls(source, specials)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return str(
                self._template.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self._specials
                )
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
