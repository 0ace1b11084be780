"""A streamed response: SSE chunks in its endpoint's form as the engine's updates arrive (deltas
of text, tool calls and log probabilities), an error chunk for a failure once the stream has
begun, the usage chunk when asked for, and `[DONE]`. The usage row is durable before the last
bytes: a client that saw `[DONE]` is billed. `MeteredStream`, the response that carries the
chunks (and the Responses API's events), meters a stream however it ends."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from gateway.http.errors import APIError, api_error
from gateway.openai.answer import Answer, status_of, violation_body
from gateway.openai.output_checks import OutputChecks
from gateway.tenancy.metering import STATUS_ERROR, STATUS_OK

logger = logging.getLogger(__name__)


async def sse_chunks(answer: Answer, checks: OutputChecks) -> AsyncGenerator[str]:
    async with contextlib.aclosing(chunk_bodies(answer, checks)) as bodies:
        async for data in bodies:
            yield f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


async def chunk_bodies(answer: Answer, checks: OutputChecks) -> AsyncGenerator[dict[str, Any]]:
    """Each chunk's JSON body (an error's body once the stream has begun), the usage chunk
    when asked for; the usage row is written before the last."""
    form = answer.form
    opening = form.opening(answer.choices)
    if opening:
        yield _chunk(answer, opening)
    status = STATUS_OK
    try:
        async with contextlib.aclosing(answer.updates) as updates:
            async for prompt_index, update in updates:
                choice = answer.apply(prompt_index, update)
                if not update.text_delta and not update.finished:
                    continue
                body = form.chunk_choice(choice, update)
                if body is None:
                    continue
                body["logprobs"] = (
                    form.logprobs(answer.tokenizer, update.new_token_ids, update.new_logprobs)
                    if update.new_logprobs
                    else None
                )
                if update.finished and answer.params.guided is not None:
                    await checks.check(answer.params.guided, choice, answer.request_id)
                body["finish_reason"] = choice.answered_reason
                body |= violation_body(choice)
                yield _chunk(answer, [body])
        status = status_of(answer.choices)
    except Exception as exc:  # noqa: BLE001 - the stream has begun: report it in the stream
        status = STATUS_ERROR
        err = api_error(exc)
        if err is None:
            logger.exception("stream %s failed", answer.request_id)
            err = APIError(
                500, f"internal server error ({answer.request_id})", type="internal_error"
            )
        yield err.body()
    answer.timer.finish(answer.choices, answer.usage)
    await answer.end(status)
    if answer.include_usage:
        yield _chunk(answer, [], answer.usage.body(answer.choices))


def _chunk(answer: Answer, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": answer.request_id,
        "object": answer.form.chunk_object,
        "created": answer.created,
        "model": answer.model,
        "choices": choices,
    }
    if answer.include_usage:
        data["usage"] = usage
    return data


class MeteredStream(StreamingResponse):
    """A stream whose request is metered however the response ends. The chunks' generator
    records the row itself when it runs to the end; `on_close` covers the rest (a client gone
    mid-stream, or before the first chunk, when the generator never ran at all) and ends what
    the response was streaming."""

    def __init__(
        self,
        content: AsyncGenerator[str],
        on_close: Callable[[], Awaitable[None]],
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._on_close()
            finally:
                await self._content.aclose()
