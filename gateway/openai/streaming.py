"""Plumbing of a response's updates: several prompts' engine streams merged into one
`UpdateStream` (which owns them), a whole response abandoned when its client hangs up, and an
SSE response metered however it ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi.responses import StreamingResponse

from engine.outputs import SequenceUpdate

# Resolves when the client has hung up (a whole response is then not worth computing).
Disconnected = Callable[[], Awaitable[None]]


class UpdateStream:
    """A response's engine updates as (prompt index, update), in prompt order, and their one
    owner: `open` waits for the first (so that the engine's refusals, a context too long or a
    grammar, are HTTP errors before anything is answered); closing it aborts the engine's
    requests that still run, and closing it again does nothing."""

    __slots__ = ("_first", "_rest")

    def __init__(
        self,
        first: tuple[int, SequenceUpdate] | None,
        rest: AsyncGenerator[tuple[int, SequenceUpdate]],
    ) -> None:
        self._first = first
        self._rest = rest

    @classmethod
    async def open(cls, streams: list[AsyncGenerator[SequenceUpdate]]) -> UpdateStream:
        """The streams merged, their first update received; a failure closes every stream."""
        rest = merge(streams)
        try:
            first = await anext(rest)
        except StopAsyncIteration:
            return cls(None, rest)
        except BaseException:
            await rest.aclose()  # the other prompts' requests end too
            raise
        return cls(first, rest)

    def __aiter__(self) -> UpdateStream:
        return self

    async def __anext__(self) -> tuple[int, SequenceUpdate]:
        first, self._first = self._first, None
        if first is not None:
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()  # a closed generator closes as nothing


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


async def merge(
    streams: list[AsyncGenerator[SequenceUpdate]],
) -> AsyncGenerator[tuple[int, SequenceUpdate]]:
    """Interleave several requests' updates, tagged with their prompt index."""
    if len(streams) == 1:
        # Closing explicitly aborts the request now, not when the generator is collected.
        try:
            async for update in streams[0]:
                yield 0, update
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, SequenceUpdate | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[SequenceUpdate]) -> None:
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
