"""The Responses API's other ways in, through the openai SDK against a live loragate (demo
model): `responses.input_tokens.count` (the same body's input, counted and not run), and the
WebSocket mode (`responses.connect`): several responses on one socket, errors that leave it
open, the key checked at the upgrade, and a hang-up that aborts the engine's sequence and is
billed for what was produced."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import Server, demo_server, new_tenant
from response_events import event_violations
from sqlalchemy import func, select
from tool_schemas import WEATHER
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tenants.models import Usage

TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": WEATHER["function"]["parameters"],
    "strict": True,
}
ENDS = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("modes")
    with demo_server(demo_model_dir, root) as server:
        yield server


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.client()


def _usage_rows(server: Server, request_ids: list[str] | None = None) -> list[Usage]:
    tenancy = server.app.state.tenancy

    async def rows() -> list[Usage]:
        assert await tenancy.ledger.flush(timeout=30)
        async with tenancy.db.session() as session:
            query = select(Usage)
            if request_ids is not None:
                query = query.where(Usage.request_id.in_(request_ids))
            return list((await session.execute(query)).scalars())

    return server.run(rows())  # type: ignore[no-any-return]


def _num_usage_rows(server: Server) -> int:
    tenancy = server.app.state.tenancy

    async def count() -> int:
        assert await tenancy.ledger.flush(timeout=30)
        async with tenancy.db.session() as session:
            return int((await session.execute(select(func.count()).select_from(Usage))).scalar())

    return server.run(count())  # type: ignore[no-any-return]


# -- input_tokens ---------------------------------------------------------------------------


def test_input_tokens_are_the_usage_of_the_same_request(
    server: Server, client: openai.OpenAI
) -> None:
    bodies: list[dict[str, Any]] = [
        {"input": "Hello there"},
        {
            "input": [{"role": "user", "content": "Weather in Paris?"}],
            "instructions": "You answer in one word.",
            "tools": [TOOL],
            "tool_choice": "required",
        },
    ]
    for body in bodies:
        rows_before = _num_usage_rows(server)
        counted = client.responses.input_tokens.count(model="demo", **body)
        assert counted.object == "response.input_tokens"
        assert _num_usage_rows(server) == rows_before  # counting runs nothing, bills nothing
        ran = client.responses.create(model="demo", max_output_tokens=2, **body)
        assert ran.usage is not None and counted.input_tokens == ran.usage.input_tokens
    # A later turn counts its stored history too.
    follow = {"previous_response_id": ran.id, "input": "And in Rome?"}
    counted = client.responses.input_tokens.count(model="demo", **follow)
    ran = client.responses.create(model="demo", max_output_tokens=2, **follow)
    assert ran.usage is not None and counted.input_tokens == ran.usage.input_tokens


def test_input_tokens_refuse_what_the_route_refuses(server: Server, client: openai.OpenAI) -> None:
    theirs = server.client(new_tenant(server, "counted-elsewhere")[1])
    other = theirs.responses.create(model="demo", input="mine", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # another tenant's id is an unknown one
        client.responses.input_tokens.count(model="demo", input="x", previous_response_id=other.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_tokens.count(model="demo", input=[{"role": "robot", "content": "x"}])
    assert refused.value.body["param"] == "input[0].role"  # type: ignore[index]


# -- the WebSocket mode ---------------------------------------------------------------------


def _one_response(connection: Any) -> list[Any]:
    """The events of the response under way, up to its last."""
    events = []
    for event in connection:
        events.append(event)
        if event.type in ENDS or event.type == "error":
            return events
    raise AssertionError("the socket closed mid-response")


def test_three_responses_on_one_socket_are_the_http_ones(client: openai.OpenAI) -> None:
    asks = ["Tell me about rivers.", "And mountains?", "And the sea?"]
    over_http = [
        client.responses.create(model="demo", input=ask, max_output_tokens=8, temperature=0)
        for ask in asks
    ]
    with client.responses.connect() as connection:
        for ask, expected in zip(asks, over_http, strict=True):
            connection.response.create(model="demo", input=ask, max_output_tokens=8, temperature=0)
            events = _one_response(connection)
            for event in events:
                assert event_violations(event.model_dump(by_alias=True)) == []
            assert [e.sequence_number for e in events] == list(range(len(events)))
            final = events[-1].response
            assert final.status == expected.status
            assert final.output_text == expected.output_text
            assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_refused_message_is_an_error_event_and_the_socket_goes_on(
    server: Server, client: openai.OpenAI
) -> None:
    with client.responses.connect() as connection:
        connection.send({"type": "response.create", "model": "demo", "input": []})  # type: ignore[arg-type, typeddict-item]
        (error,) = _one_response(connection)
        assert error.type == "error" and error.status == 400
        assert error.error.param == "input"
        connection.send({"type": "response.create", "model": "nope", "input": "x"})  # type: ignore[arg-type, typeddict-item]
        (error,) = _one_response(connection)
        assert error.status == 404
        connection.send(
            {"type": "response.create", "model": "demo", "input": "x", "background": True}  # type: ignore[arg-type, typeddict-item]
        )
        (error,) = _one_response(connection)
        assert error.status == 400 and error.error.param == "background"
        connection.response.create(model="demo", input="x", generate=False)
        (error,) = _one_response(connection)
        assert error.status == 400 and error.error.param == "generate"
        # Two sent at once: the second waits for the first to end.
        for ask in ("first", "second"):
            connection.response.create(model="demo", input=ask, max_output_tokens=3)
        first, second = _one_response(connection), _one_response(connection)
        assert first[-1].type in ENDS and second[-1].type in ENDS
        assert first[-1].response.id != second[-1].response.id


def test_the_key_is_checked_at_the_upgrade(server: Server) -> None:
    """Refused with the status and body `POST /v1/responses` answers the same key with."""
    url = server.base_url.replace("http://", "ws://") + "/v1/responses"
    for headers in ({}, {"Authorization": "Bearer lg-not-a-key"}):
        posted = httpx.post(f"{server.base_url}/v1/responses", headers=headers, json={})
        assert posted.status_code == 401
        with pytest.raises(InvalidStatus) as refused:
            connect(url, additional_headers=headers, open_timeout=10)
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body or b"{}") == posted.json()


def _socket(server: Server) -> ClientConnection:
    url = server.base_url.replace("http://", "ws://") + "/v1/responses"
    return connect(url, additional_headers=server.headers, open_timeout=10)


def test_a_hang_up_mid_response_aborts_it_and_bills_what_was_made(server: Server) -> None:
    socket = _socket(server)
    create = {
        "type": "response.create",
        "model": "demo",
        "input": "Go on for a long time.",
        "max_output_tokens": 900,
        "ignore_eos": True,
    }
    socket.send(json.dumps(create))
    response_id = None
    deltas = 0
    while deltas < 3:
        event = json.loads(socket.recv(timeout=30))
        if event["type"] == "response.created":
            response_id = event["response"]["id"]
        deltas += event["type"] == "response.output_text.delta"
    socket.close()
    assert response_id is not None
    assert server.wait_all_blocks_free(30), "the engine still runs the abandoned response"
    (row,) = _usage_rows(server, [response_id])
    assert row.status == "aborted" and row.endpoint == "responses"
    assert 3 <= row.completion_tokens < 900


# -- compaction -----------------------------------------------------------------------------


def _chat(turns: int) -> list[dict[str, Any]]:
    """A conversation of `turns` user turns with their answers, a function call and its
    output in the middle."""
    items: list[dict[str, Any]] = []
    for turn in range(turns):
        items.append({"role": "user", "content": f"Turn {turn}: tell me about the river."})
        items.append({"role": "assistant", "content": f"Answer {turn}: it is long and wide."})
        if turn == turns // 2:
            items.append(
                {
                    "type": "function_call",
                    "call_id": "call_mid",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                }
            )
            items.append({"type": "function_call_output", "call_id": "call_mid", "output": "sun"})
    return items


def test_compaction_summarises_the_older_turns_and_keeps_the_rest(
    server: Server, client: openai.OpenAI
) -> None:
    conversation = _chat(30)
    compacted = client.responses.compact(model="demo", input=conversation)  # type: ignore[arg-type]
    assert compacted.object == "response.compaction"
    kinds = [item.type for item in compacted.output]
    assert kinds[0] == "compaction"
    assert kinds[1:3] == ["function_call", "function_call_output"]  # kept whole
    assert compacted.output[1].call_id == "call_mid"  # type: ignore[union-attr]
    recent = [item.content[0].text for item in compacted.output[3:]]  # type: ignore[union-attr]
    assert recent == [i["content"] for i in conversation[-4:]]  # the last two turns, as they were
    assert compacted.usage.output_tokens > 0
    (row,) = _usage_rows(server, [compacted.id])
    assert row.endpoint == "responses_compact" and row.status == "ok"
    assert row.completion_tokens == compacted.usage.output_tokens
    # The compacted items are the next request's input, and a shorter one.
    follow = [item.model_dump(exclude_none=True) for item in compacted.output]
    follow.append({"role": "user", "content": "And now?"})
    whole = [*conversation, {"role": "user", "content": "And now?"}]
    short = client.responses.input_tokens.count(model="demo", input=follow)  # type: ignore[arg-type]
    long = client.responses.input_tokens.count(model="demo", input=whole)  # type: ignore[arg-type]
    assert short.input_tokens < long.input_tokens
    answered = client.responses.create(model="demo", input=follow, max_output_tokens=4)  # type: ignore[arg-type]
    assert answered.status in ("completed", "incomplete")


def test_compaction_reads_a_stored_chain_and_refuses_what_it_cannot(
    server: Server, client: openai.OpenAI
) -> None:
    previous = None
    for turn in range(4):
        previous = client.responses.create(
            model="demo", input=f"turn {turn}", max_output_tokens=4, previous_response_id=previous
        ).id
    compacted = client.responses.compact(model="demo", previous_response_id=previous)
    assert [item.type for item in compacted.output][0] == "compaction"
    assert len(compacted.output) == 1 + 4  # the summary, then the last two turns' four items
    # Nothing before the last turns: nothing run, the items as they were, no usage row.
    short = [{"role": "user", "content": "only this"}]
    unchanged = client.responses.compact(model="demo", input=short)  # type: ignore[arg-type]
    assert [item.type for item in unchanged.output] == ["message"]
    assert unchanged.usage.total_tokens == 0 and _usage_rows(server, [unchanged.id]) == []
    forged = {"type": "compaction", "encrypted_content": "gAAAA-someone-elses"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="demo", input=[forged])  # type: ignore[list-item]
    assert refused.value.body["param"] == "input[0].encrypted_content"  # type: ignore[index]
    theirs = server.client(new_tenant(server, "compacted-elsewhere")[1])
    with pytest.raises(openai.NotFoundError):
        theirs.responses.compact(model="demo", previous_response_id=previous)
