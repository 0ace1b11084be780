"""The client's per-request stream: updates a reader fell behind on come as one."""

from __future__ import annotations

import asyncio

from engine.frontend.loop_client import _Stream
from engine.outputs import SequenceUpdate


def _update(index: int, token: int, finish: str | None = None) -> SequenceUpdate:
    return SequenceUpdate(
        request_id="r",
        index=index,
        new_token_ids=[token],
        text_delta=f"<{token}>",
        new_logprobs=[{token: -0.5}],
        num_prompt_tokens=3,
        num_cached_tokens=token,
        queue_time=0.25 if token == 1 else 0.0,
        finish_reason=finish,
    )


async def _read(items: list[SequenceUpdate | BaseException], n: int) -> list[object]:
    stream = _Stream(asyncio.get_running_loop(), n)
    for item in items:
        stream.queue.put_nowait(item)
    read = []
    while stream._backlog or not stream.queue.empty():
        read.append(await stream.next())
    return read


def test_updates_queued_behind_each_other_are_read_as_one() -> None:
    read = asyncio.run(_read([_update(0, 1), _update(0, 2), _update(0, 3, "length")], 1))
    assert len(read) == 1
    (merged,) = read
    assert isinstance(merged, SequenceUpdate)
    assert merged.new_token_ids == [1, 2, 3]
    assert merged.text_delta == "<1><2><3>"
    assert merged.new_logprobs == [{1: -0.5}, {2: -0.5}, {3: -0.5}]
    assert merged.finish_reason == "length" and merged.finished
    assert merged.queue_time == 0.25  # the first update's: when the request was scheduled
    assert merged.num_cached_tokens == 3


def test_merging_stops_at_another_sample_a_finish_and_an_error() -> None:
    error = RuntimeError("step failed")
    items: list[SequenceUpdate | BaseException] = [
        _update(0, 1),
        _update(0, 2),
        _update(1, 3),
        _update(1, 4, "stop"),
        _update(1, 5),
        error,
    ]
    read = asyncio.run(_read(items, 2))
    shapes = [item.new_token_ids if isinstance(item, SequenceUpdate) else item for item in read]
    assert shapes == [[1, 2], [3, 4], [5], error]


def test_a_reader_that_keeps_up_reads_every_update_on_its_own() -> None:
    async def main() -> list[list[int]]:
        stream = _Stream(asyncio.get_running_loop(), 1)
        read = []
        for token in (1, 2, 3):
            stream.queue.put_nowait(_update(0, token))
            item = await stream.next()
            assert isinstance(item, SequenceUpdate)
            read.append(item.new_token_ids)
        return read

    assert asyncio.run(main()) == [[1], [2], [3]]
