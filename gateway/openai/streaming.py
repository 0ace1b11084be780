"""Plumbing of a response's updates: merging several prompts' engine streams, a whole response
abandoned when its client hangs up, and an SSE response metered however it ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi.responses import StreamingResponse

from engine.outputs import SequenceUpdate

# Resolves when the client has hung up (a whole response is then not worth computing).
Disconnected = Callable[[], Awaitable[None]]


class MeteredStream(StreamingResponse):
    """A stream whose request is metered however the response ends. The chunks' generator
    records the row itself when it runs to the end; `on_close` covers the rest: a client gone
    mid-stream, or before the first chunk, when the generator never ran at all."""

    def __init__(
        self,
        content: AsyncGenerator[str],
        on_close: Callable[[], None],
        updates: AsyncGenerator[Any],
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._content = content
        self._on_close = on_close
        self._updates = updates

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._content.aclose()
            await self._updates.aclose()  # aborts the engine's requests if they still run


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


async def chain(
    first: tuple[int, SequenceUpdate] | None, rest: AsyncIterator[tuple[int, SequenceUpdate]]
) -> AsyncGenerator[tuple[int, SequenceUpdate]]:
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def merge(
    streams: list[AsyncIterator[SequenceUpdate]],
) -> AsyncGenerator[tuple[int, SequenceUpdate]]:
    """Interleave several requests' updates, tagged with their prompt index."""
    if len(streams) == 1:
        # Closing explicitly aborts the request now, not when the generator is collected.
        try:
            async for update in streams[0]:
                yield 0, update
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, SequenceUpdate | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[SequenceUpdate]) -> None:
        try:
            async for update in stream:
                await queue.put((index, update))
            await queue.put((index, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
