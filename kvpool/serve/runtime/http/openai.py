"""The OpenAI completions API: parsing a request body, shaping answers, API errors.

``parse_completion`` turns a ``POST /v1/completions`` body into a
``CompletionRequest`` or raises ``ApiError`` (a 4xx with OpenAI's error
object); the shaping functions build the ``text_completion`` objects and
server-sent-event chunks from a ``ServeRequest``. Nothing here does I/O.

Accepted fields: ``prompt`` (text, tokenized by the model's tokenizer, or a
list of token ids; a batch of one is unwrapped), ``max_tokens`` (default
16), ``stream``, ``stream_options.include_usage``, ``ignore_eos``, ``stop``
and ``stop_token_ids`` (``stopping``), ``model`` (must be the served name
when given), ``user``, sampling: ``temperature`` (default 0: greedy),
``top_p``, ``top_k`` and ``seed`` (``runtime.sampling``: the same seed gives
the same tokens; without one each request draws its own), ``n`` (1 to
``MAX_N`` completions, choice ``i`` sampled with its own seed derived from
the request's) and ``logprobs`` (0 to ``MAX_LOGPROBS``: the sampled token's
log-probability and that many alternatives per token; in chat,
``logprobs: true`` and ``top_logprobs``). Log-probabilities are the model's
(log-softmax of the raw logits, before temperature/top-k/top-p). The other
scoring parameters are accepted only at their neutral values (``NEUTRAL``:
``best_of`` 1, ``echo`` false, penalties 0, ...); any other value, and any
unknown field, answers 400 naming it, never silently ignored.
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
from kvpool.serve.runtime.sampling import GREEDY, MAX_LOGPROBS, SamplingParams, TokenLogprobs
from kvpool.serve.runtime.tokenizer import TextTokenizer

DEFAULT_MAX_TOKENS = 16
#: Parameters not implemented here, accepted only at these (no-op) values.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
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
ACCEPTED |= {"stop_token_ids", "user", "seed", "temperature", "top_p", "top_k", "n", "logprobs"}
#: The most completions one request may ask for (``n``).
MAX_N = 16


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
    sampling: SamplingParams = GREEDY  # its ``logprobs``: alternatives per token, None: off
    n: int = 1  # completions to generate (choice i samples with ``sampling.for_choice(i)``)


def check_parameters(body: dict[str, Any], chat: bool = False) -> None:
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
        elif name == "top_logprobs" and not chat:
            raise ApiError(
                400,
                "'top_logprobs' is a chat parameter: completions take 'logprobs' (an integer)",
                param=name,
                code="unsupported_parameter",
            )
        elif name not in ACCEPTED and not (chat and name == "top_logprobs"):
            raise ApiError(
                400, f"unknown parameter {name!r}", param=name, code="unsupported_parameter"
            )


def parse_completion(
    body: Any, settings: ServeSettings, tokenizer: TextTokenizer, *, chat: bool = False
) -> CompletionRequest:
    """Validated request fields, or ApiError (4xx) (``chat``: chat's ``logprobs`` form)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != settings.served_name:
        raise ApiError(
            404, f"model {model!r} is not served here", param="model", code="model_not_found"
        )
    check_parameters(body, chat)
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
        sampling=parse_sampling(body, chat),
        n=parse_n(body),
    )


def _number(body: dict[str, Any], name: str, default: float | None, kind: type = float) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind | int):
        raise ApiError(400, f"'{name}' must be a {kind.__name__}", param=name)
    return value


def parse_n(body: dict[str, Any]) -> int:
    n = _number(body, "n", 1, int)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be between 1 and {MAX_N}", param="n")
    return int(n)


def parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Alternatives per token, or None: completions' ``logprobs`` (an integer), or
    chat's ``logprobs`` (a boolean) with ``top_logprobs`` (an integer, needs it true)."""
    if chat:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise ApiError(400, "'logprobs' must be a boolean in chat", param="logprobs")
        top = body.get("top_logprobs")
        if top is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        name, k = "top_logprobs", (_number(body, "top_logprobs", 0, int) if on else None)
    else:
        name, k = "logprobs", _number(body, "logprobs", None, int)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"'{name}' must be between 0 and {MAX_LOGPROBS}", param=name)
    return None if k is None else int(k)


def parse_sampling(body: dict[str, Any], chat: bool = False) -> SamplingParams:
    """``temperature``, ``top_p``, ``top_k`` (-1 or 0: off), ``seed`` (None: a fresh one),
    logprobs (``parse_logprobs``)."""
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
    logprobs = parse_logprobs(body, chat)
    return SamplingParams(temperature, top_p, max(0, top_k), seed, logprobs)


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


def usage(reqs: list[ServeRequest]) -> dict[str, Any]:
    """Over every choice: the prompt once, the completions' tokens summed, and the
    prompt tokens the first choice found in the pool."""
    generated = sum(len(r.output) for r in reqs)
    prompt = len(reqs[0].tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": reqs[0].cached_tokens},
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
        "id": req.response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **more,
    }


def choice(
    text: str,
    finish: str | None,
    token_ids: list[int],
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "token_ids": token_ids,
    }


def completion_logprobs(
    tokenizer: TextTokenizer,
    tokens: list[int],
    lps: list[TokenLogprobs | None],
    offset: int = 0,
) -> dict[str, Any]:
    """The completions API's ``logprobs`` object for ``tokens`` (text offsets from
    ``offset``). ``top_logprobs`` maps each alternative's text to its logprob, the
    sampled token included (so up to k + 1 entries, as OpenAI)."""
    texts = [tokenizer.decode([t]) for t in tokens]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    top: list[dict[str, float] | None] = []
    values: list[float | None] = []
    for text, lp in zip(texts, lps, strict=True):
        if lp is None:
            values.append(None)
            top.append(None)
            continue
        alts = {tokenizer.decode([int(i)]): float(v) for i, v in lp[1]}
        alts.setdefault(text, float(lp[0]))
        values.append(float(lp[0]))
        top.append(alts)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


def stream_chunk(
    req: ServeRequest,
    model: str,
    text: str,
    token: int | None,
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
) -> str:
    """One event of choice ``req.index`` (its id: the response's, ``req.response_id``)."""
    ids = [] if token is None else [token]
    return sse(completion_body(req, model, [choice(text, finish, ids, req.index, logprobs)]))
