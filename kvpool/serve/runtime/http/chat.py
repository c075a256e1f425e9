"""``POST /v1/chat/completions``: messages through the checkpoint's chat template.

``parse_chat`` checks ``messages`` (a non-empty list of ``{"role": str,
"content": str}``), renders them with the checkpoint's template
(``checkpoint.chat.ChatTemplate``; 400 when the model has none, as with the
presets) and hands the token ids to ``parse_completion``, so every other
field (``max_tokens`` or ``max_completion_tokens``, ``stop``, ``stream``, the
sampling parameters) is checked exactly as for a completion. The shaping
functions build ``chat.completion`` objects and ``chat.completion.chunk``
events (the first chunk's delta carries the role).
"""

from __future__ import annotations

import time
from typing import Any

from kvpool.serve.runtime.checkpoint.chat import ChatTemplate, ChatTemplateError
from kvpool.serve.runtime.http.openai import ApiError, CompletionRequest, parse_completion, sse
from kvpool.serve.runtime.http.state import ServeRequest, ServeSettings
from kvpool.serve.runtime.tokenizer import TextTokenizer


def parse_chat(
    body: Any, settings: ServeSettings, tokenizer: TextTokenizer, template: ChatTemplate | None
) -> CompletionRequest:
    """Validated chat request (its prompt rendered and tokenized), or ApiError (4xx)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if template is None:
        raise ApiError(
            400, "this model has no chat template: use /v1/completions", code="no_chat_template"
        )
    body = dict(body)
    messages = body.pop("messages", None)
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    for m in messages:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ApiError(
                400,
                "each message must be {'role': string, 'content': string}",
                param="messages",
            )
    if "prompt" in body:
        raise ApiError(400, "'prompt' is not a chat parameter", param="prompt")
    if "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    try:
        text = template.render(messages)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    body["prompt"] = tokenizer.encode(text, add_bos=False)  # the template wrote BOS
    return parse_completion(body, settings, tokenizer)


def _base(req: ServeRequest, model: str, kind: str) -> dict[str, Any]:
    return {"id": req.id, "object": kind, "created": int(time.time()), "model": model}


def chat_body(req: ServeRequest, model: str, text: str, finish: str, **more: Any) -> dict[str, Any]:
    """The whole ``chat.completion`` answer."""
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return {**_base(req, model, "chat.completion"), "choices": [choice], **more}


def chat_chunk(
    req: ServeRequest,
    model: str,
    text: str | None,
    finish: str | None,
    *,
    first: bool = False,
    **more: Any,
) -> str:
    """One ``chat.completion.chunk`` event (``text`` None: no choices, for the usage chunk)."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text:
        delta["content"] = text
    choices = [] if text is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return sse({**_base(req, model, "chat.completion.chunk"), "choices": choices, **more})
