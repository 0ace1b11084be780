"""A response's update plumbing alone (gateway/openai/answer.py's UpdateStream and merge,
json_response.py's unless_disconnected): several prompts' engine streams merged and tagged, an
update stream that receives its first update on opening and owns the streams, a failure that
ends every sibling stream, and a whole response cancelled when its client hangs up first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.outputs import SequenceUpdate
from gateway.openai.answer import UpdateStream, merge
from gateway.openai.json_response import unless_disconnected


def _update(request: str, text: str) -> SequenceUpdate:
    return SequenceUpdate(request, 0, [1], text, None, 3, 0)


class _Stream:
    """An engine stream of given updates (then, optionally, an error), that records being
    closed early: a closed stream is what aborts its engine request."""

    def __init__(self, request: str, texts: list[str], error: Exception | None = None) -> None:
        self.request, self.texts, self.error = request, texts, error
        self.closed = False

    def __aiter__(self) -> AsyncIterator[SequenceUpdate]:
        return self._run()

    async def _run(self) -> AsyncIterator[SequenceUpdate]:
        try:
            for text in self.texts:
                await asyncio.sleep(0)
                yield _update(self.request, text)
            if self.error is not None:
                raise self.error
            await asyncio.sleep(3600 if self.texts == ["forever"] else 0)
        finally:
            self.closed = True

    async def aclose(self) -> None:
        self.closed = True


async def _drain(stream: AsyncIterator[tuple[int, SequenceUpdate]]) -> list[tuple[int, str]]:
    return [(i, u.text_delta) async for i, u in stream]


def test_merge_tags_each_prompts_updates_in_their_order() -> None:
    async def run() -> None:
        a, b = _Stream("a", ["a1", "a2", "a3"]), _Stream("b", ["b1", "b2"])
        got = await _drain(merge([a.__aiter__(), b.__aiter__()]))
        assert sorted(got) == [(0, "a1"), (0, "a2"), (0, "a3"), (1, "b1"), (1, "b2")]
        assert [t for i, t in got if i == 0] == ["a1", "a2", "a3"]  # each prompt in order

    asyncio.run(run())


def test_a_failing_stream_fails_the_merge_and_stops_its_siblings() -> None:
    async def run() -> None:
        bad = _Stream("bad", ["x"], RuntimeError("engine step failed"))
        slow = _Stream("slow", ["forever"])
        merged = merge([bad.__aiter__(), slow.__aiter__()])
        with pytest.raises(RuntimeError, match="engine step failed"):
            await _drain(merged)
        await asyncio.sleep(0)  # the pumps' cancellation runs
        assert slow.closed

    asyncio.run(run())


def test_an_update_stream_opens_on_its_first_update_and_closes_its_streams() -> None:
    async def run() -> None:
        stream = _Stream("r", ["1", "2", "3"])
        updates = await UpdateStream.open([stream.__aiter__()])
        assert not stream.closed  # the first update received, the rest still to come
        assert await _drain(updates) == [(0, "1"), (0, "2"), (0, "3")]
        assert await _drain(await UpdateStream.open([_Stream("e", []).__aiter__()])) == []

        a, b = _Stream("a", ["forever"]), _Stream("b", ["forever"])
        early = await UpdateStream.open([a.__aiter__(), b.__aiter__()])
        assert (await anext(early))[1].text_delta == "forever"
        await early.aclose()  # closing aborts what still runs
        await early.aclose()  # and closing again is nothing
        await asyncio.sleep(0)  # the pumps' cancellation runs
        assert a.closed and b.closed
        assert await _drain(early) == []

        failing = _Stream("bad", [], RuntimeError("refused"))
        sibling = _Stream("slow", ["forever"])
        with pytest.raises(RuntimeError, match="refused"):
            await UpdateStream.open([failing.__aiter__(), sibling.__aiter__()])
        await asyncio.sleep(0)
        assert sibling.closed

    asyncio.run(run())


def test_a_whole_response_is_cancelled_when_its_client_hangs_up_first() -> None:
    async def run() -> None:
        cancelled = asyncio.Event()

        async def work() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def hangs_up() -> None:
            await asyncio.sleep(0)

        assert not await unless_disconnected(work(), hangs_up)
        assert cancelled.is_set()

        async def quick() -> None:
            return None

        async def never() -> None:
            await asyncio.sleep(3600)

        assert await unless_disconnected(quick(), never)
        assert await unless_disconnected(quick(), None)

        async def fails() -> None:
            raise ValueError("a bug in the work")

        with pytest.raises(ValueError, match="a bug"):
            await unless_disconnected(fails(), never)

    asyncio.run(run())
