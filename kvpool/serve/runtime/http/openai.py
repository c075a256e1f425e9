"""The OpenAI completions API: parsing a request body, shaping answers, API errors.

``parse_completion`` turns a ``POST /v1/completions`` body into a
``CompletionRequest`` or raises ``ApiError`` (a 4xx with OpenAI's error
object); the shaping functions build the ``text_completion`` objects and
server-sent-event chunks from a ``ServeRequest``. Nothing here does I/O.

Accepted fields: ``prompt`` (text, tokenized by the model's tokenizer, or a
list of token ids; a batch of one is unwrapped), ``max_tokens`` (default
16), ``stream``, ``stream_options.include_usage``, ``ignore_eos``, ``stop``
and ``stop_token_ids`` (``stopping``), ``model`` (must be the served name
when given), ``user``, and sampling: ``temperature`` (default 0: greedy),
``top_p``, ``top_k`` and ``seed`` (``runtime.sampling``: the same seed gives
the same tokens; without one each request draws its own). The other scoring
parameters are accepted only at their neutral values (``NEUTRAL``: ``n`` 1,
``logprobs`` null, penalties 0, ...); any other value, and any unknown field,
answers 400 naming it, never silently ignored.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from kvpool.serve.runtime.http.state import ServeRequest, ServeSettings
from kvpool.serve.runtime.http.stopping import parse_stop
from kvpool.serve.runtime.sampling import GREEDY, SamplingParams
from kvpool.serve.runtime.tokenizer import TextTokenizer

DEFAULT_MAX_TOKENS = 16
#: Parameters not implemented here, accepted only at these (no-op) values.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "suffix": (None,),
    "min_tokens": (None, 0),
}
#: Parameters implemented here (``user`` is only an identifier).
ACCEPTED = {"model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos", "stop"}
ACCEPTED |= {"stop_token_ids", "user", "seed", "temperature", "top_p", "top_k"}


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error object (429 and 503 add Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions request."""

    tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    eos_id: int | None  # None with ignore_eos (or a model without the byte vocabulary)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = GREEDY


def check_parameters(body: dict[str, Any]) -> None:
    """ApiError(400) naming the first parameter this server would otherwise ignore."""
    for name, value in body.items():
        if name in NEUTRAL:
            neutral = NEUTRAL[name]
            if not any((value == v and type(value) is not bool) or value is v for v in neutral):
                raise ApiError(
                    400,
                    f"'{name}' = {value!r} is not supported by this server "
                    f"(accepted: {', '.join(repr(v) for v in neutral)})",
                    param=name,
                    code="unsupported_parameter",
                )
        elif name not in ACCEPTED:
            raise ApiError(
                400, f"unknown parameter {name!r}", param=name, code="unsupported_parameter"
            )


def parse_completion(
    body: Any, settings: ServeSettings, tokenizer: TextTokenizer
) -> CompletionRequest:
    """Validated request fields, or ApiError (4xx)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != settings.served_name:
        raise ApiError(
            404, f"model {model!r} is not served here", param="model", code="model_not_found"
        )
    check_parameters(body)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", param="prompt")
    tokens = _prompt_tokens(body["prompt"], settings.model.vocab_size, tokenizer)
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise ApiError(400, "'max_tokens' must be an integer", param="max_tokens")
    if not 1 <= max_tokens <= settings.max_tokens_limit:
        raise ApiError(
            400,
            f"'max_tokens' must be between 1 and {settings.max_tokens_limit}",
            param="max_tokens",
        )
    limit = min(settings.model.max_context, settings.decode_kv_tokens)
    if len(tokens) + max_tokens - 1 > limit:
        raise ApiError(
            400,
            f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"context of {limit} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    try:
        stop, stop_ids = parse_stop(body, settings.model.vocab_size)
    except ValueError as exc:
        param = str(exc).split(":")[0]
        raise ApiError(400, str(exc), param=param) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    ignore_eos = bool(body.get("ignore_eos", False))
    return CompletionRequest(
        tokens=tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        eos_id=None if ignore_eos else settings.eos_id,
        stop=stop,
        # a checkpoint's other EOS ids (Llama 3 has several) stop it too
        stop_token_ids=stop_ids if ignore_eos else stop_ids | settings.eos_ids,
        sampling=parse_sampling(body),
    )


def _number(body: dict[str, Any], name: str, default: float, kind: type = float) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind | int):
        raise ApiError(400, f"'{name}' must be a {kind.__name__}", param=name)
    return value


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    """``temperature``, ``top_p``, ``top_k`` (-1 or 0: off), ``seed`` (None: a fresh one)."""
    temperature = float(_number(body, "temperature", 0.0))
    top_p = float(_number(body, "top_p", 1.0))
    top_k = int(_number(body, "top_k", 0, int))
    seed = int(_number(body, "seed", secrets.randbits(63), int))
    for name, ok in (
        ("temperature", 0 <= temperature <= 100),
        ("top_p", 0 < top_p <= 1),
        ("top_k", top_k >= -1),
    ):
        if not ok:
            raise ApiError(400, f"'{name}' is out of range", param=name)
    return SamplingParams(temperature, top_p, max(0, top_k), seed)


def _prompt_tokens(prompt: Any, vocab: int, tokenizer: TextTokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="prompt")
        tokens = list(prompt)
    else:
        raise ApiError(
            400,
            "'prompt' must be a string or a list of token ids (batches are not supported)",
            param="prompt",
        )
    if not tokens:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    return tokens


# -- answers -------------------------------------------------------------------------


def finish_reason(req: ServeRequest) -> str:
    """``stop`` (EOS, a stop token or string), else ``length`` (max_tokens reached)."""
    if req.stopper is not None and req.stopper.finish:
        return req.stopper.finish
    return "stop" if req.output and req.output[-1] == req.eos_id else "length"


def usage(req: ServeRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": len(req.tokens),
        "completion_tokens": len(req.output),
        "total_tokens": len(req.tokens) + len(req.output),
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def extras(req: ServeRequest) -> dict[str, Any]:
    """The ``kvpool`` field: workers used, cached/computed tokens, TTFT, timings."""
    return {
        "prefill_worker": req.prefill_worker,
        "decode_worker": req.decode_worker,
        "cached_tokens": req.cached_tokens,
        "computed_tokens": req.computed_tokens,
        "ttft_s": req.ttft,
        "tbt_mean_s": (sum(req.tbt) / len(req.tbt)) if req.tbt else None,
        "prefill_timings": req.prefill_timings,
        "pipeline": req.pipeline,  # the stages' workers when pipelined, else []
    }


def completion_body(
    req: ServeRequest, model: str, choices: list[dict[str, Any]], **more: Any
) -> dict[str, Any]:
    """A text_completion object (a whole response or one stream chunk)."""
    return {
        "id": req.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **more,
    }


def choice(text: str, finish: str | None, token_ids: list[int]) -> dict[str, Any]:
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "token_ids": token_ids,
    }


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


def stream_chunk(
    req: ServeRequest, model: str, text: str, token: int | None, finish: str | None
) -> str:
    return sse(
        completion_body(req, model, [choice(text, finish, [] if token is None else [token])])
    )
