"""What the Responses API's objects and events must look like, from two sources no one here
wrote: the openai SDK's types, and the Open Responses specification (version 2026-04-24) as
the `openresponses-types` package models it. `violations` names every way a response body
or a streamed event departs from either; `SpecWatch` runs it over everything a live test
server answers under /v1/responses, so each test that talks to the Responses API checks the
shapes it produced without saying so."""

from __future__ import annotations

import json
import typing
from typing import Any

import openresponses_types as spec
import pydantic
from openai.types.responses import Response, ResponseStreamEvent
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _sdk_event_classes() -> dict[str, Any]:
    (union, _) = typing.get_args(ResponseStreamEvent)
    return {
        typing.get_args(kind.model_fields["type"].annotation)[0]: kind
        for kind in typing.get_args(union)
    }


EVENTS = _sdk_event_classes()


def _spec_models() -> tuple[type[pydantic.BaseModel], dict[str, type[pydantic.BaseModel]]]:
    """The spec's ResponseResource and its streaming events by `type`.

    The generated JsonSchemaResponseFormat types `schema` as None where the spec says an
    object or null; corrected here, and every model after it rebuilt to see the change."""
    field = spec.JsonSchemaResponseFormat.model_fields["schema_"]
    field.annotation = dict[str, Any] | None
    models = [
        value
        for value in vars(spec.types).values()
        if isinstance(value, type)
        and issubclass(value, pydantic.BaseModel)
        and value.__module__ == spec.types.__name__
    ]
    for model in models:
        model.model_rebuild(force=True)
    events: dict[str, type[pydantic.BaseModel]] = {}
    for model in models:
        name = model.__name__
        if not (name.endswith("StreamingEvent") and "type" in model.model_fields):
            continue
        (kind, *_) = typing.get_args(model.model_fields["type"].annotation) or (
            model.model_fields["type"].annotation,
        )
        values = [member.value for member in kind] if isinstance(kind, type) else [kind]
        events |= dict.fromkeys(values, model)
    return spec.ResponseResource, events


SPEC_RESPONSE, SPEC_EVENTS = _spec_models()


def _errors(model: type[pydantic.BaseModel], data: Any, source: str) -> list[str]:
    try:
        model.model_validate(data)
    except pydantic.ValidationError as exc:
        return [
            f"{source} {model.__name__}: {'.'.join(map(str, e['loc']))}: {e['msg']}"
            for e in exc.errors()
        ]
    return []


def response_violations(body: Any) -> list[str]:
    """How a response object departs from the spec and from the SDK's `Response`."""
    return _errors(SPEC_RESPONSE, body, "spec") + _errors(Response, body, "sdk")


def event_violations(data: Any) -> list[str]:
    """How a streamed event departs from the spec's and the SDK's type for its `type`."""
    kind = data.get("type") if isinstance(data, dict) else None
    found = []
    for source, classes in (("spec", SPEC_EVENTS), ("sdk", EVENTS)):
        model = classes.get(kind)  # type: ignore[arg-type]
        if model is None:
            found.append(f"{source}: no event of type {kind!r}")
        else:
            found += _errors(model, data, source)
    return found


def sse_violations(text: str) -> list[str]:
    """Every event of an SSE body checked, and the stream's own rules: sequence numbers
    dense from 0, each `event:` line naming its data's type."""
    found: list[str] = []
    sequence = 0
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" not in lines:
            continue
        data = json.loads(lines["data"])
        found += event_violations(data)
        if lines.get("event") != data.get("type"):
            found.append(f"event line {lines.get('event')!r} for type {data.get('type')!r}")
        if data.get("sequence_number") != sequence:
            found.append(f"sequence_number {data.get('sequence_number')} where {sequence}")
        sequence += 1
    return found


class SpecWatch:
    """ASGI middleware: every 200 under /v1/responses (an object, or an event stream)
    checked as it passes; what departs is kept in `violations`, with the path."""

    def __init__(self, app: ASGIApp, violations: list[str]) -> None:
        self.app = app
        self.violations = violations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/responses"):
            await self.app(scope, receive, send)
            return
        status = 0
        kind = ""
        body = bytearray()

        async def watching(message: Message) -> None:
            nonlocal status, kind
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers") or [])
                kind = headers.get(b"content-type", b"").decode()
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body") and status == 200:
                    self._check(scope["method"], path, kind, bytes(body))
            await send(message)

        await self.app(scope, receive, watching)

    def _check(self, method: str, path: str, kind: str, body: bytes) -> None:
        if kind.startswith("text/event-stream"):
            found = sse_violations(body.decode())
        elif method == "DELETE" or path.endswith("/input_items"):
            return  # not a response object
        else:
            found = response_violations(json.loads(body))
        self.violations += [f"{method} {path}: {v}" for v in found]
