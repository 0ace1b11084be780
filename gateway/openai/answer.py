"""What a response accumulates while its engine updates arrive: each choice's text, tokens,
finish and guided or tool-call state, the usage figures, the latency metrics, and the
finish reason and status its usage row records; `Answer` holds them for one response, from
the engine's first update to the last byte, whether it answers in one JSON body or in SSE.

An `AnswerForm` is the shape of one endpoint's answer (chat's in gateway.openai.chat,
completions' in gateway.openai.completions): the JSON and SSE responders ask it, never which
endpoint they answer for.

The updates themselves arrive as one `UpdateStream`: several prompts' engine streams merged,
opened on the first update, and their one owner (closing it aborts the engine's requests)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.outputs import SequenceUpdate
from engine.request import SamplingParams
from gateway.http.errors import APIError
from gateway.metrics import Latency, Metrics
from gateway.openai.guided_validation import Violation
from gateway.openai.tools.stream import ToolCallStream
from gateway.tenancy.metering import STATUS_ABORTED, STATUS_OK, Meter, UsageFigures


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


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # the engine's; metering and request_success count it
    stop_reason: int | str | None = None  # a stop string or token id of the client's
    violation: Violation | None = None  # a guided document that failed its schema
    calls: ToolCallStream | None = None  # the output of a request with tools

    @property
    def answered_reason(self) -> str | None:
        """The finish reason the client sees: `error` for a document or call that failed its
        schema, `tool_calls` for an output that ended where its grammar ends holding calls."""
        if self.violation is not None:
            return "error"
        if (
            self.calls is not None
            and self.finish_reason == "stop"
            and self.stop_reason is None
            and self.calls.final(self.text)[1]
        ):
            return "tool_calls"
        return self.finish_reason


@dataclass(slots=True)
class Usage:
    """Prompt figures per prompt: its n samples share one prompt (and its cache hits)."""

    prompts: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)

    def record(self, prompt_index: int, update: SequenceUpdate) -> None:
        self.prompts[prompt_index] = update.num_prompt_tokens
        self.cached[prompt_index] = max(self.cached.get(prompt_index, 0), update.num_cached_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompts.values())

    def figures(self, choices: list[Choice]) -> UsageFigures:
        return UsageFigures(
            self.prompt_tokens, sum(self.cached.values()), sum(len(c.token_ids) for c in choices)
        )

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


@dataclass(slots=True)
class Timer:
    """Per-request latency figures, observed into the metrics as updates arrive."""

    metrics: Metrics
    latency: Latency  # the metrics' interactive or batch histograms
    start: float = field(default_factory=time.monotonic)
    last: float | None = None

    def update(self, update: SequenceUpdate) -> None:
        now = time.monotonic()
        if self.last is None:
            # Earlier by the update's decode time where it holds tokens of several steps.
            self.latency.ttft.observe(max(0.0, now - self.start - update.decode_time))
            self.latency.queue_time.observe(update.queue_time)
        elif update.decode_time == 0.0:
            self.latency.itl.observe(now - self.last)
        if update.decode_time > 0.0 and len(update.new_token_ids) > 1:
            # A FINAL_ONLY update's tokens came over its decode time: their gaps, evenly, so
            # that the histogram's sum and count stay those of the tokens made.
            gaps = len(update.new_token_ids) - 1
            for _ in range(gaps):
                self.latency.itl.observe(update.decode_time / gaps)
        self.last = now

    def finish(self, choices: list[Choice], usage: Usage) -> None:
        m = self.metrics
        self.latency.e2e.observe(time.monotonic() - self.start)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(sum(len(c.token_ids) for c in choices))
        for choice in choices:
            m.request_success.labels(finish_reason=choice.finish_reason or "abort").inc()


def violation_body(choice: Choice) -> dict[str, Any]:
    """The `error` field beside a choice whose document failed its schema; nothing otherwise."""
    return {} if choice.violation is None else {"error": choice.violation.body()}


def status_of(choices: list[Choice]) -> str:
    """How a request whose updates all arrived ended: cut short by the engine (an abort, at
    shutdown) or finished."""
    return STATUS_ABORTED if any(c.finish_reason == "abort" for c in choices) else STATUS_OK


def usage_finish_reason(choices: list[Choice]) -> str | None:
    """The usage row's finish reason: the first choice's (`abort` if it never finished)."""
    return choices[0].finish_reason or "abort" if choices else None


class AnswerForm(Protocol):
    """The shape of one endpoint's answer: its objects' names, its choices whole and as
    chunks, its log probabilities."""

    @property
    def object(self) -> str:
        """The whole answer's `object`."""
        ...

    @property
    def chunk_object(self) -> str:
        """Each SSE chunk's `object`."""
        ...

    @property
    def prompt_param(self) -> str:
        """The field a prompt too long for the context is refused by."""
        ...

    def opening(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """The choices of a stream's first chunk, before any update; none: no such chunk."""
        ...

    def chunk_choice(self, choice: Choice, update: SequenceUpdate) -> dict[str, Any] | None:
        """A chunk's choice for an update just applied to it: its index and what it adds
        (the logprobs, finish reason and error follow); None: nothing to send yet."""
        ...

    def whole_choice(self, choice: Choice, tokenizer: Any) -> dict[str, Any]:
        """A collected choice as the whole answer shows it."""
        ...

    def logprobs(
        self, tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]]
    ) -> dict[str, Any]:
        """`entries[i]` maps the top token ids at step i (the chosen one among them) to their
        log probabilities."""
        ...


@dataclass(slots=True)
class Answer:
    """One response under way: its engine updates (the first already received), the choices
    and usage they fill, its latency timer and usage meter, and what its response carries.
    The JSON and the SSE responders share it; `updates` is the one owner of the engine's
    streams."""

    request_id: str
    model: str  # as the client named it
    form: AnswerForm
    params: SamplingParams
    stream: bool  # answered in SSE chunks, else in one JSON body
    include_usage: bool  # SSE: a last chunk with the usage
    tokenizer: Any  # the model's: log probabilities' tokens
    headers: dict[str, str]  # the limiter's, on the response
    choices: list[Choice]
    usage: Usage
    timer: Timer
    meter: Meter
    updates: UpdateStream
    created: int = field(default_factory=lambda: int(time.time()))  # epoch seconds

    def apply(self, prompt_index: int, update: SequenceUpdate) -> Choice:
        """The update added to its choice (and the usage); the choice it belongs to."""
        self.timer.update(update)
        self.meter.first_token(update.decode_time)
        choice = self.choices[prompt_index * self.params.n + update.index]
        self.usage.record(prompt_index, update)
        choice.token_ids.extend(update.new_token_ids)
        choice.text += update.text_delta
        if update.new_logprobs:
            choice.logprobs.extend(update.new_logprobs)
        if update.finished:
            choice.finish_reason = update.finish_reason
            choice.stop_reason = update.stop_reason
            if update.error:  # it failed alone in an engine step
                raise APIError(500, update.error, type="internal_error")
        return choice

    async def end(self, status: str) -> None:
        """The usage row, durable before this returns."""
        await self.meter.end(self.figures, usage_finish_reason(self.choices), status)

    def end_nowait(self, status: str) -> None:
        """The usage row, written in the background (a cancelled response cannot wait)."""
        self.meter.end_nowait(self.figures, usage_finish_reason(self.choices), status)

    async def abandon(self) -> None:
        """A response that ends before its updates did (a client gone mid-stream, or before
        the first chunk): the row as aborted, unless it was written, and the engine's
        requests that still run aborted."""
        self.end_nowait(STATUS_ABORTED)
        await self.updates.aclose()

    @property
    def figures(self) -> UsageFigures:
        return self.usage.figures(self.choices)
