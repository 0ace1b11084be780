"""A streamed response: the chat path's chunks as the Responses API's events, in OpenAI's
order and shapes, each with its `sequence_number`:

    response.created, response.in_progress
    for the text:   output_item.added, content_part.added, output_text.delta ...,
                    output_text.done, content_part.done, output_item.done
    for each call:  output_item.added, function_call_arguments.delta ...,
                    function_call_arguments.done, output_item.done
    response.completed (response.incomplete at max_output_tokens; response.failed on error)

The output items it builds are the final response's, so that the SDK's stream helper
reassembles the same object a non-streamed call returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.responses.items import new_id
from gateway.openai.responses.objects import (
    ResponseMeta,
    call_item,
    item_status,
    logprobs_body,
    message_item,
    text_part,
)


@dataclass(slots=True)
class _Open:
    """An output item being streamed."""

    index: int
    item: dict[str, Any]
    text: str = ""  # a message's text, or a call's arguments
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, if asked


@dataclass(slots=True)
class EventStream:
    meta: ResponseMeta
    sequence: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    _message: _Open | None = None
    _calls: dict[int, _Open] = field(default_factory=dict)  # by the chat call's index

    def start(self) -> list[dict[str, Any]]:
        body = self.meta.body("in_progress", [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat chunk's events (none for the role chunk)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"], logprobs_body(choice.get("logprobs")))
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(
        self, status: str, usage: dict[str, Any] | None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events, and the final response object."""
        events = self._close_all(item_status(self.finish_reason))
        body = self.meta.body(status, self.output, usage, finish_reason=self.finish_reason)
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            status, "response.completed"
        )
        return [*events, self._event(kind, response=body)], body

    def fail(self, error: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """A failure once the stream has begun: what was produced, and the error."""
        events = self._close_all("incomplete")
        body = self.meta.body("failed", self.output, error=error)
        payload = {
            "type": str(error.get("type") or "server_error"),
            "code": error.get("code"),
            "message": str(error.get("message", "the response failed")),
            "param": error.get("param"),
        }
        # The openai SDK reads the error's fields at the top of the event, the Open
        # Responses spec under `error`: both are there.
        flat = {k: payload[k] for k in ("code", "message", "param")}
        return [
            *events,
            self._event("error", **flat, error=payload),
            self._event("response.failed", response=body),
        ], body

    # -- items ------------------------------------------------------------------------------

    def _text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            item = message_item(new_id("msg"), "", status="in_progress")
            self._message = _Open(len(self.output), item)
            self.output.append(item)
            events += [
                self._event(
                    "response.output_item.added", output_index=self._message.index, item=item
                ),
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._message.index,
                    content_index=0,
                    part=text_part(""),
                ),
            ]
        self._message.text += delta
        self._message.logprobs += logprobs
        return [
            *events,
            self._event(
                "response.output_text.delta",
                item_id=self._message.item["id"],
                output_index=self._message.index,
                content_index=0,
                delta=delta,
                logprobs=logprobs,
            ),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        opened = self._calls.get(index)
        if opened is None:
            item = call_item(
                new_id("fc"), call.get("id") or new_id("call"), function.get("name", ""), "",
                status="in_progress",
            )  # fmt: skip
            opened = self._calls[index] = _Open(len(self.output), item)
            self.output.append(item)
            events.append(
                self._event("response.output_item.added", output_index=opened.index, item=item)
            )
        arguments = function.get("arguments")
        if arguments:
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            opened.text += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=opened.item["id"],
                    output_index=opened.index,
                    delta=arguments,
                )
            )
        return events

    def _close_all(self, status: str) -> list[dict[str, Any]]:
        """Every open item done, as `status` says (incomplete: the response was cut)."""
        events = []
        if self._message is not None:
            opened, self._message = self._message, None
            item = message_item(opened.item["id"], opened.text, status, opened.logprobs)
            self.output[opened.index] = item
            where = {"item_id": item["id"], "output_index": opened.index, "content_index": 0}
            part = item["content"][0]
            events += [
                self._event(
                    "response.output_text.done",
                    **where,
                    text=opened.text,
                    logprobs=part["logprobs"],
                ),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=opened.index, item=item),
            ]
        for opened in self._calls.values():
            item = dict(opened.item, arguments=opened.text, status=status)
            self.output[opened.index] = item
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=opened.index,
                    arguments=opened.text,
                ),
                self._event("response.output_item.done", output_index=opened.index, item=item),
            ]
        self._calls = {}
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return data


def sse(event: dict[str, Any]) -> str:
    """An event as an SSE frame: its `event:` line names its type."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
