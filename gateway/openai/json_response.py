"""A whole response: every update collected (metered however that ends), each output checked,
then one OpenAI JSON body in its endpoint's form (`chat.completion` or `text_completion`); the
collecting is cancelled if the client hangs up first (`unless_disconnected`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from gateway.openai.answer import Answer, status_of
from gateway.openai.output_checks import OutputChecks
from gateway.tenancy.metering import STATUS_ABORTED, STATUS_ERROR

# Resolves when the client has hung up (a whole response is then not worth computing).
Disconnected = Callable[[], Awaitable[None]]


async def collect(answer: Answer) -> None:
    """Every update of the answer's choices; the usage row is written however this ends."""
    status = STATUS_ERROR
    try:
        async with contextlib.aclosing(answer.updates) as updates:
            async for prompt_index, update in updates:
                answer.apply(prompt_index, update)
        status = status_of(answer.choices)
    except asyncio.CancelledError:
        answer.end_nowait(STATUS_ABORTED)
        raise
    finally:
        await answer.end(status)


async def json_body(answer: Answer, checks: OutputChecks) -> dict[str, Any]:
    """The collected answer as OpenAI's body, each guided output checked first."""
    if answer.params.guided is not None:
        for choice in answer.choices:
            await checks.check(answer.params.guided, choice, answer.request_id)
    answer.timer.finish(answer.choices, answer.usage)
    form = answer.form
    return {
        "id": answer.request_id,
        "object": form.object,
        "created": answer.created,
        "model": answer.model,
        "choices": [form.whole_choice(c, answer.tokenizer) for c in answer.choices],
        "usage": answer.usage.body(answer.choices),
    }


async def unless_disconnected(
    work: Coroutine[Any, Any, None], disconnected: Disconnected | None
) -> bool:
    """Run `work` unless the client hangs up first (then cancel it: a whole response nobody
    waits for is not worth computing). True if it ran to the end; its errors propagate."""
    if disconnected is None:
        await work
        return True
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()
    return True
