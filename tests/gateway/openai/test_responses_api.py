"""The Responses API through the openai SDK against a live loragate (demo model): plain text,
conversations through `previous_response_id` (their history found in the prefix cache),
`store: false`, function tools (forced, then their output as the next turn), `text.format`
json_schema, streaming reassembled by the SDK's helper into the non-streamed object,
background responses and their cancellation, stored responses scoped to their tenant, the
bounds (the per-tenant cap, the TTL), refusals naming their field, one usage row each."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from live_server import Server, demo_server, new_tenant
from openai.types.responses import Response
from response_events import EVENTS
from sqlalchemy import select
from tool_schemas import WEATHER

from tenants.models import Usage

SCHEMA = WEATHER["function"]["parameters"]
TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA, "strict": True}
LONG = {"ignore_eos": True}  # the demo model's answers run to max_output_tokens


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("responses")
    with demo_server(
        demo_model_dir, root, settings={"responses_max_stored_per_tenant": 50}
    ) as server:
        yield server


@pytest.fixture(autouse=True)
def shapes_follow_the_spec(server: Server) -> Iterator[None]:
    """Every response object and event a test here produced is checked against the Open
    Responses spec and the openai SDK's types (response_events.SpecWatch)."""
    yield
    found = list(server.spec_violations)
    server.spec_violations.clear()
    assert found == []


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.client()


def _raw(server: Server, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(
        method, f"{server.base_url}/v1{path}", headers=server.headers, timeout=60, **kwargs
    )


def test_a_text_response_is_openais_object(server: Server, client: openai.OpenAI) -> None:
    body = {"model": "demo", "input": "Hello there", "max_output_tokens": 8, "temperature": 0}
    raw = _raw(server, "POST", "/responses", json=body | LONG)
    assert raw.status_code == 200, raw.text
    response = Response.model_validate(raw.json())  # the SDK's own type, validated
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 8
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete"  # cut at max_output_tokens, its text kept
    assert response.output_text == message.content[0].text != ""
    assert response.completed_at is None  # set only once a response completes
    # Through the SDK: the same answer (greedy).
    again = client.responses.create(
        model="demo", input="Hello there", max_output_tokens=8, temperature=0, extra_body=LONG
    )
    assert again.output_text == response.output_text
    assert client.responses.retrieve(again.id).output_text == again.output_text


def test_a_conversation_continues_from_its_stored_turns(client: openai.OpenAI) -> None:
    previous, cached, inputs = None, [], []
    for turn in range(4):
        response = client.responses.create(
            model="demo",
            input=f"Turn {turn}: tell me more about the weather in a few words.",
            previous_response_id=previous,
            max_output_tokens=12,
            temperature=0,
            instructions="You are terse.",
            extra_body=LONG,
        )
        assert response.previous_response_id == previous
        assert response.usage is not None
        inputs.append(response.usage.input_tokens)
        cached.append(response.usage.input_tokens_details.cached_tokens)
        previous = response.id
    # Each turn's prompt holds the last one's whole conversation, which the cache kept.
    assert inputs == sorted(inputs) and len(set(inputs)) == 4
    assert cached[0] < cached[1] < cached[2] < cached[3]
    assert all(c >= i - 64 for c, i in zip(cached[1:], inputs[:-1], strict=True))
    items = client.responses.input_items.list(previous, order="asc")
    (item,) = items.data
    assert item.type == "message" and "Turn 3" in item.content[0].text


def test_store_false_stores_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model="demo", input="hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="demo", input="on", previous_response_id=response.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_another_tenants_response_is_an_unknown_id(server: Server, client: openai.OpenAI) -> None:
    mine = client.responses.create(model="demo", input="secret", max_output_tokens=2)
    _, key = new_tenant(server, "other-responses")
    other = server.client(key)
    unknown = "resp_" + "0" * 32
    for call in (
        lambda rid: other.responses.retrieve(rid),
        lambda rid: other.responses.delete(rid),
        lambda rid: other.responses.input_items.list(rid),
        lambda rid: other.responses.cancel(rid),
        lambda rid: other.responses.create(model="demo", input="x", previous_response_id=rid),
    ):
        errors = []
        for rid in (mine.id, unknown):
            with pytest.raises(openai.NotFoundError) as caught:
                call(rid)
            errors.append(json.dumps(caught.value.body).replace(rid, "ID"))
        assert errors[0] == errors[1]
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_a_forced_function_call_and_its_output_as_the_next_turn(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="demo",
        input="What is the weather in Paris?",
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=96,
        temperature=0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    second = client.responses.create(
        model="demo",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}],
        previous_response_id=first.id,
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice="none",  # auto needs a --tool-call-parser, as chat's does
        max_output_tokens=8,
        temperature=0,
        extra_body=LONG,
    )
    assert second.output[0].type == "message" and second.output_text


def test_the_response_says_what_it_ran_with(client: openai.OpenAI) -> None:
    """Every field the spec requires, with the values used: the request's or the defaults."""
    plain = client.responses.create(model="demo", input="Hi", max_output_tokens=4)
    assert (plain.presence_penalty, plain.frequency_penalty, plain.top_logprobs) == (0, 0, 0)
    assert plain.service_tier == "default" and plain.max_tool_calls is None
    assert plain.safety_identifier is None and plain.prompt_cache_key is None
    fmt = {
        "type": "json_schema",
        "name": "weather",
        "description": "A weather report",
        "schema": SCHEMA,
    }
    tool = {k: v for k, v in TOOL.items() if k != "strict"}
    started = int(time.time())
    response = client.responses.create(
        model="demo",
        input="Weather in Paris?",
        max_output_tokens=96,
        temperature=0,
        # Spec fields the openai SDK does not name.
        extra_body={"presence_penalty": 0.5, "frequency_penalty": -0.25},
        top_logprobs=3,
        max_tool_calls=2,
        service_tier="auto",
        safety_identifier="user-1234",
        prompt_cache_key="weather-v1",
        text={"format": fmt},  # type: ignore[typeddict-item]
        tools=[tool],  # type: ignore[list-item]
        tool_choice="none",
    )
    assert response.status == "completed"
    assert response.completed_at is not None and response.completed_at >= started
    assert (response.presence_penalty, response.frequency_penalty) == (0.5, -0.25)
    assert (response.top_logprobs, response.max_tool_calls) == (3, 2)
    assert response.service_tier == "default"  # the one tier there is
    assert response.safety_identifier == "user-1234"
    assert response.prompt_cache_key == "weather-v1"
    echoed = response.text.format  # type: ignore[union-attr]
    assert echoed.type == "json_schema" and echoed.description == "A weather report"
    assert echoed.strict is True  # the schema was enforced: strict unless told otherwise
    (function,) = response.tools
    assert function.type == "function" and function.strict is True


def test_logprobs_come_with_the_text_when_included(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "demo",
        "input": "Hello",
        "max_output_tokens": 6,
        "temperature": 0,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
        "extra_body": LONG,
    }
    whole = client.responses.create(**kwargs)
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert len(part.logprobs) == 6  # type: ignore[union-attr, arg-type]
    assert "".join(lp.token for lp in part.logprobs) == part.text  # type: ignore[union-attr]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)  # type: ignore[union-attr]
    # The top alternative at each step is the token greedy picked.
    assert all(lp.top_logprobs[0].token == lp.token for lp in part.logprobs)  # type: ignore[union-attr]
    with client.responses.stream(**kwargs) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]  # type: ignore[union-attr]
    without = client.responses.create(**(kwargs | {"include": None}))
    assert without.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_json_schema_output_always_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    for seed in range(3):
        response = client.responses.create(
            model="demo",
            input="Give me a weather report as JSON.",
            text={"format": fmt},  # type: ignore[typeddict-item]
            max_output_tokens=96,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), SCHEMA)


@pytest.mark.parametrize("ends", ["completed", "with_calls", "incomplete"])
def test_a_stream_reassembles_into_the_whole_response(client: openai.OpenAI, ends: str) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    kwargs: dict[str, Any] = {
        "model": "demo",
        "input": "Stream me something about Paris.",
        "max_output_tokens": 96,
        "temperature": 0,
        "text": {"format": fmt},  # ends where its grammar does: completed
    }
    if ends == "with_calls":
        kwargs |= {"tools": [TOOL], "tool_choice": "required", "text": None}
    if ends == "incomplete":
        kwargs |= {"max_output_tokens": 12, "text": None, "extra_body": LONG}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    whole = client.responses.create(**kwargs)
    assert whole.status == ("incomplete" if ends == "incomplete" else "completed")
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        # The SDK's helper gives a final object only for response.completed, as OpenAI's does.
        final = stream.get_final_response() if ends != "incomplete" else events[-1].response  # type: ignore[union-attr]
    for event in events:
        EVENTS[event.type].model_validate(event.model_dump(by_alias=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type == f"response.{whole.status}"
    assert final.status == whole.status
    assert final.output_text == whole.output_text
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [
        (o.type, getattr(o, "arguments", None)) for o in whole.output
    ]
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_background_response_is_polled_and_can_be_cancelled(client: openai.OpenAI) -> None:
    done = client.responses.create(
        model="demo", input="quick", max_output_tokens=4, background=True, extra_body=LONG
    )
    assert done.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(done.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert polled.status == "incomplete" and polled.usage.output_tokens == 4  # type: ignore[union-attr]
    long = client.responses.create(
        model="demo", input="long", max_output_tokens=900, background=True, extra_body=LONG
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    # Deleting one that runs stops it, and it stays deleted.
    running = client.responses.create(
        model="demo", input="long", max_output_tokens=900, background=True, extra_body=LONG
    )
    client.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model="demo", input="x").id)


def test_unsupported_values_are_refused_by_name(server: Server) -> None:
    cases = [
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": ["hi", 7]}]}, "input[0].content[0]"),
        ({"background": True, "store": False}, "background"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"include": ["message.output_text.everything"]}, "include.0"),
        (
            {
                "input": [
                    {
                        "type": "function_call",
                        "call_id": "c1",
                        "name": "get weather!",
                        "arguments": "{}",
                    }
                ]
            },
            "input[0].name",
        ),
        ({"service_tier": "gold"}, "service_tier"),
        ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
    ]
    for extra, param in cases:
        raw = _raw(server, "POST", "/responses", json={"model": "demo", "input": "x"} | extra)
        assert raw.status_code == 400, (extra, raw.text)
        error = raw.json()["error"]
        assert error["param"] == param, (extra, error)
        assert error["type"] == "invalid_request_error"


def test_a_405_lists_the_methods_of_the_path_as_the_schema_names_it(server: Server) -> None:
    # /v1/responses/compact is its own resource (OpenAPI matches concrete paths first), not a
    # response id: GET and DELETE there reach /v1/responses/{response_id}, but it has POST only.
    assert _raw(server, "PUT", "/responses/compact").headers["allow"] == "POST"
    assert _raw(server, "PUT", "/responses/resp_1").headers["allow"] == "DELETE, GET"


def test_delete_and_input_items(client: openai.OpenAI) -> None:
    items = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "input_text", "text": "three"}]},
    ]
    response = client.responses.create(
        model="demo",
        input=items,  # type: ignore[arg-type]
        max_output_tokens=2,
    )
    listed = client.responses.input_items.list(response.id)  # newest first
    assert [i.content[0].text for i in listed.data] == ["three", "two", "one"]  # type: ignore[union-attr]
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["one", "two"]  # type: ignore[union-attr]
    assert page.has_more
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_each_response_has_one_usage_row(server: Server, client: openai.OpenAI) -> None:
    made = [
        client.responses.create(model="demo", input="a", max_output_tokens=3, extra_body=LONG).id
        for _ in range(2)
    ]
    with client.responses.stream(
        model="demo", input="b", max_output_tokens=3, extra_body=LONG
    ) as stream:
        made.append(list(stream)[-1].response.id)  # type: ignore[union-attr]
    # A cancelled background response has its row too, with what it produced.
    long = client.responses.create(
        model="demo", input="long", max_output_tokens=900, background=True, extra_body=LONG
    )
    assert client.responses.cancel(long.id).status == "cancelled"
    tenancy = server.app.state.tenancy

    async def rows() -> list[Usage]:
        assert await tenancy.ledger.flush(timeout=30)
        async with tenancy.db.session() as session:
            found = await session.execute(select(Usage).where(Usage.request_id.in_(made)))
            return list(found.scalars())

    whole = list(made)
    made.append(long.id)
    found = server.run(rows())
    assert sorted(r.request_id for r in found) == sorted(made)  # one row each, by the id
    by_id = {r.request_id: r for r in found}
    assert {r.endpoint for r in found} == {"responses"}
    assert {(by_id[i].completion_tokens, by_id[i].status) for i in whole} == {(3, "ok")}
    assert by_id[long.id].status == "aborted" and by_id[long.id].completion_tokens < 900


def test_the_cap_and_the_ttl_hold_on_the_live_server(server: Server) -> None:
    """The store the server runs with: past the per-tenant cap the oldest goes; past the TTL a
    response is a 404 at once and the sweep deletes it."""
    store = server.app.state.tenancy.responses
    _, key = new_tenant(server, "capped-responses")
    client = server.client(key)
    cap, store.max_per_tenant = store.max_per_tenant, 2
    try:
        made = [
            client.responses.create(model="demo", input=str(i), max_output_tokens=1).id
            for i in range(3)
        ]
    finally:
        store.max_per_tenant = cap
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0])
    assert [client.responses.retrieve(rid).id for rid in made[1:]] == made[1:]
    later = datetime.now(UTC) + timedelta(seconds=store.ttl.total_seconds() + 1)
    assert server.run(store.sweep(now=later)) >= 2
    for rid in made[1:]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)


def test_truncation_drops_the_oldest_turns_only_when_asked(client: openai.OpenAI) -> None:
    """The demo server's context is 1,024 tokens; three turns of ~400 do not fit together."""
    long_turn = " ".join(["lantern meadow harbor"] * 40)
    previous = None
    for _ in range(2):
        previous = client.responses.create(
            model="demo",
            input=long_turn,
            previous_response_id=previous,
            max_output_tokens=4,
            extra_body=LONG,
        ).id
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="demo", input=long_turn, previous_response_id=previous, max_output_tokens=4
        )
    assert caught.value.body["param"] == "input"  # type: ignore[index]
    assert caught.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    fitted = client.responses.create(
        model="demo",
        input=long_turn,
        previous_response_id=previous,
        max_output_tokens=4,
        truncation="auto",
        extra_body=LONG,
    )
    assert fitted.status == "incomplete" and fitted.truncation == "auto"
    assert fitted.usage is not None and fitted.usage.input_tokens + 4 <= 1024
