"""``POST /v1/chat/completions``: messages through the checkpoint's chat template.

``parse_chat`` checks ``messages`` (a non-empty list of ``{"role": str,
"content": str}``), renders them with the checkpoint's template
(``checkpoint.chat.ChatTemplate``; 400 when the model has none, as with the
presets) and hands the token ids to ``parse_completion``, so every other
field (``max_tokens`` or ``max_completion_tokens``, ``stop``, ``stream``, the
sampling parameters) is checked exactly as for a completion. The shaping
functions build ``chat.completion`` objects and ``chat.completion.chunk``
events (the first chunk's delta of each choice carries the role), and chat's
``logprobs`` object (``logprobs: true``, ``top_logprobs`` alternatives).
"""

from __future__ import annotations

import time
from typing import Any

from kvpool.serve.runtime.checkpoint.chat import ChatTemplate, ChatTemplateError
from kvpool.serve.runtime.http.openai import ApiError, CompletionRequest, parse_completion, sse
from kvpool.serve.runtime.http.state import ServeRequest, ServeSettings
from kvpool.serve.runtime.sampling import TokenLogprobs
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
    return parse_completion(body, settings, tokenizer, chat=True)


def _base(req: ServeRequest, model: str, kind: str) -> dict[str, Any]:
    return {"id": req.response_id, "object": kind, "created": int(time.time()), "model": model}


def _token(tokenizer: TextTokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([int(token)])
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}


def chat_logprobs(
    tokenizer: TextTokenizer, tokens: list[int], lps: list[TokenLogprobs | None]
) -> dict[str, Any]:
    """Chat's ``logprobs`` object: per token its text, logprob, UTF-8 bytes (of the
    decoded text) and ``top_logprobs`` (the requested number of alternatives)."""
    content = []
    for tok, lp in zip(tokens, lps, strict=True):
        if lp is None:
            continue
        entry = _token(tokenizer, tok, lp[0])
        entry["top_logprobs"] = [_token(tokenizer, i, v) for i, v in lp[1]]
        content.append(entry)
    return {"content": content}


def chat_choice(
    req: ServeRequest, text: str, finish: str, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """One choice of a whole ``chat.completion``."""
    message = {"role": "assistant", "content": text}
    return {"index": req.index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def chat_body(
    req: ServeRequest, model: str, choices: list[dict[str, Any]], **more: Any
) -> dict[str, Any]:
    """The whole ``chat.completion`` answer (``req``: its first choice)."""
    return {**_base(req, model, "chat.completion"), "choices": choices, **more}


def chat_chunk(
    req: ServeRequest,
    model: str,
    text: str | None,
    finish: str | None,
    *,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    **more: Any,
) -> str:
    """One ``chat.completion.chunk`` event of choice ``req.index`` (``text`` None: no
    choices, for the usage chunk)."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text:
        delta["content"] = text
    one = {"index": req.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    choices = [] if text is None else [one]
    return sse({**_base(req, model, "chat.completion.chunk"), "choices": choices, **more})
