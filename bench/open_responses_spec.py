"""What the Responses API's objects and events must look like, from two sources no one here
wrote: the openai SDK's types, and the Open Responses specification (version 2026-04-24) as
the `openresponses-types` package models it (a development dependency: the benchmarks and
the tests read it, the product never does). `response_violations`, `event_violations` and
`sse_violations` name every way a response body, an event or a whole stream departs from
either."""

from __future__ import annotations

import enum
import json
import typing
from typing import Any

import openresponses_types as spec
import pydantic
from openai.types.responses import (
    InputTokenCountResponse,
    Response,
    ResponseStreamEvent,
)


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
        kind = model.model_fields["type"].annotation  # a one-member StrEnum
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            events |= {member.value: model for member in kind}
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


def compacted_violations(body: Any) -> list[str]:
    """How a `/responses/compact` answer departs from the spec's CompactResource. (The
    SDK's CompactedResponse types its output as output items, so a user message, which its
    own documentation says the output lists, does not validate there: the SDK does not
    validate what it reads, and the spec is the reference here.)"""
    return _errors(spec.CompactResource, body, "spec")


def input_tokens_violations(body: Any) -> list[str]:
    """How an `/responses/input_tokens` answer departs from the SDK's type (the spec's
    TokenCountsResource says no more)."""
    return _errors(InputTokenCountResponse, body, "sdk")


def violations_at(method: str, path: str, body: Any) -> list[str] | None:
    """The check for what `method path` under /v1/responses answered (200); None where it
    answers no object of the spec's (a deletion, a list of items)."""
    parts = path.removeprefix("/v1/responses").strip("/").split("/")
    if method == "DELETE" or parts[-1] == "input_items":
        return None
    if parts == ["compact"]:
        return compacted_violations(body)
    if parts == ["input_tokens"]:
        return input_tokens_violations(body)
    return response_violations(body)
