"""The answers of ``kvpool serve``'s HTTP API, from the requests ``Dispatcher`` carries.

``Answers.stream`` turns a request's choices (one, or ``n``) into server-sent
events: each choice's chunks (``text_completion`` or ``chat.completion.chunk``,
naming the choice's ``index``, with its logprobs when asked) interleaved as
the choices produce them (``_merge``), then the usage chunk when asked and
``[DONE]``; an error mid-stream is an ``error`` event. ``Answers.complete``
waits for every choice and builds the whole object. When the client leaves a
stream, every choice's generator is closed at once, which cancels its decode
(``Dispatcher.tokens`` ends the request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from kvpool.serve.runtime.http.chat import chat_body, chat_choice, chat_chunk, chat_logprobs
from kvpool.serve.runtime.http.openai import (
    ApiError,
    choice,
    completion_body,
    completion_logprobs,
    extras,
    finish_reason,
    sse,
    stream_chunk,
    usage,
)
from kvpool.serve.runtime.http.state import ServeRequest

if TYPE_CHECKING:
    from kvpool.serve.runtime.http.dispatch import Dispatcher


class Answers:
    """Streams and whole answers over one front end's ``Dispatcher``."""

    def __init__(self, dispatch: Dispatcher) -> None:
        self.dispatch = dispatch
        self.settings = dispatch.settings
        self.metrics = dispatch.metrics
        self.tokenizer = dispatch.tokenizer

    def _logprobs(self, req: ServeRequest, start: int, end: int, offset: int = 0) -> Any:
        """The logprobs object of ``req``'s output tokens ``start:end`` (None: not asked
        for); ``offset``: the text offset of token ``start`` (completions)."""
        if req.sampling.logprobs is None:
            return None
        tokens, lps = req.output[start:end], req.logprobs[start:end]
        if req.chat:
            return chat_logprobs(self.tokenizer, tokens, lps)
        return completion_logprobs(self.tokenizer, tokens, lps, offset)

    async def _chunks(self, req: ServeRequest) -> AsyncGenerator[str, None]:
        """The stream events of one choice (ApiError on failure)."""
        stopper = req.stopper
        name = self.settings.served_name
        assert stopper is not None
        first, offset = True, 0
        async for token, finished, _ in self.dispatch.tokens(req):
            text = stopper.pending(finished)
            reason = finish_reason(req) if finished else None
            at = len(req.output) - 1
            lp = self._logprobs(req, at, at + 1, offset)
            if lp is not None and not req.chat:
                offset += len(lp["tokens"][0])
            if req.chat:
                yield chat_chunk(req, name, text, reason, first=first, logprobs=lp)
                first = False
            else:
                yield stream_chunk(req, name, text, token, reason, lp)

    async def stream(self, reqs: list[ServeRequest]) -> AsyncIterator[str]:
        """Server-sent events of every choice, interleaved as they are produced,
        then the usage chunk (when asked) and ``[DONE]``."""
        req = reqs[0]
        name = self.settings.served_name
        try:
            # closed at once when the client leaves: each choice's decode is cancelled
            async with contextlib.aclosing(_merge([self._chunks(r) for r in reqs])) as chunks:
                async for chunk in chunks:
                    yield chunk
            if req.include_usage and req.chat:
                yield chat_chunk(req, name, None, None, usage=usage(reqs))
            elif req.include_usage:
                more = {"usage": usage(reqs), "kvpool": self._extras(reqs)}
                yield sse(completion_body(req, name, [], **more))
            self.metrics.requests.labels("200").inc()
        except ApiError as exc:
            self.metrics.requests.labels(str(exc.status)).inc()
            yield sse(exc.body())
        yield "data: [DONE]\n\n"

    async def _drain(self, req: ServeRequest) -> None:
        async for _ in self.dispatch.tokens(req):
            pass

    async def complete(self, reqs: list[ServeRequest]) -> dict[str, Any]:
        """The whole answer once every choice has finished (ApiError if one failed)."""
        if len(reqs) == 1:
            await self._drain(reqs[0])
        else:
            tasks = [asyncio.ensure_future(self._drain(r)) for r in reqs]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:  # one failed, or the client left: stop the others
                    t.cancel()
        name, first = self.settings.served_name, reqs[0]
        choices = []
        for req in reqs:
            assert req.stopper is not None
            text, reason = req.stopper.text, finish_reason(req)
            lp = self._logprobs(req, 0, len(req.output))
            if req.chat:
                choices.append(chat_choice(req, text, reason, lp))
            else:
                choices.append(choice(text, reason, list(req.output), req.index, lp))
        more = {"usage": usage(reqs), "kvpool": self._extras(reqs)}
        if first.chat:
            return chat_body(first, name, choices, **more)
        return completion_body(first, name, choices, **more)

    @staticmethod
    def _extras(reqs: list[ServeRequest]) -> dict[str, Any]:
        """The first choice's ``kvpool`` field (with every choice's under ``choices``)."""
        out = extras(reqs[0])
        if len(reqs) > 1:
            out["choices"] = [extras(r) for r in reqs]
        return out


async def _merge(streams: list[AsyncGenerator[str, None]]) -> AsyncGenerator[str, None]:
    """The items of ``streams`` as each produces them; the first error is raised
    (the other streams cancelled), and so are they when the consumer stops early."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[str | None, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[str, None]) -> None:
        try:
            async for item in stream:
                await queue.put((item, None))
        except Exception as exc:
            await queue.put((None, exc))
        else:
            await queue.put((None, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            got, error = await queue.get()
            if error is not None:
                raise error
            if got is None:
                running -= 1
            else:
                yield got
    finally:
        for t in tasks:
            t.cancel()
