"""The Conversations API through the openai SDK against a live loragate (demo model):
conversations made, read, updated and deleted; their items added, paged both ways, read and
deleted, every body checked against the SDK's own types; items checked as the Responses API
checks its input; responses run on a conversation (its items before the input, the turn
appended after: streamed, background, cancelled); `conversation` with
`previous_response_id` refused; another tenant's conversation or item answered exactly as an
unknown one on every route; a deleted tenant's conversations gone with it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
from live_server import Server, admin_client, demo_server, new_tenant
from openai.types.conversations import (
    Conversation,
    ConversationDeletedResource,
    ConversationItem,
    ConversationItemList,
)
from openai.types.responses import Response
from sqlalchemy import func, select

from tenants.models import ConversationItemRow, ConversationRow

LONG = {"ignore_eos": True}  # the demo model's answers run to max_output_tokens
ITEM = pydantic.TypeAdapter(ConversationItem)
UNKNOWN = "conv_" + "0" * 32


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("conversations")
    with demo_server(demo_model_dir, root) as server:
        yield server


@pytest.fixture(autouse=True)
def shapes_follow_the_spec(server: Server) -> Iterator[None]:
    """Every response a test here produced (one naming a conversation echoes it) is checked
    against the Open Responses spec and the openai SDK's types (response_events.SpecWatch)."""
    yield
    found = list(server.spec_violations)
    server.spec_violations.clear()
    assert found == []


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.client()


def _raw(
    server: Server, method: str, path: str, key: str | None = None, **kw: Any
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    return httpx.request(method, f"{server.base_url}/v1{path}", headers=headers, timeout=60, **kw)


def _message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def _items(client: openai.OpenAI, conversation_id: str) -> list[Any]:
    """Every item, oldest first, through the SDK's pages."""
    return list(client.conversations.items.list(conversation_id, order="asc", limit=100))


def _text(item: Any) -> str:
    return "".join(part.text for part in item.content)


def test_a_conversation_is_made_read_updated_and_deleted(
    server: Server, client: openai.OpenAI
) -> None:
    raw = _raw(
        server,
        "POST",
        "/conversations",
        json={"items": [_message("user", "Hi")], "metadata": {"topic": "greetings"}},
    )
    assert raw.status_code == 200, raw.text
    made = Conversation.model_validate(raw.json())  # the SDK's own type
    assert made.id.startswith("conv_") and made.object == "conversation"
    assert made.metadata == {"topic": "greetings"}
    assert abs(made.created_at - time.time()) < 60

    got = client.conversations.retrieve(made.id)
    assert (got.id, got.created_at, got.metadata) == (made.id, made.created_at, made.metadata)
    updated = client.conversations.update(made.id, metadata={"topic": "rivers", "lang": "fr"})
    assert updated.metadata == {"topic": "rivers", "lang": "fr"}
    assert client.conversations.retrieve(made.id).metadata == updated.metadata
    assert client.conversations.update(made.id, metadata=None).metadata == {}  # cleared

    empty = client.conversations.create()
    assert empty.metadata == {} and _items(client, empty.id) == []

    raw = _raw(server, "DELETE", f"/conversations/{made.id}")
    assert raw.json() == {"id": made.id, "object": "conversation.deleted", "deleted": True}
    ConversationDeletedResource.model_validate(raw.json())
    with pytest.raises(openai.NotFoundError) as caught:
        client.conversations.retrieve(made.id)
    assert caught.value.body == {  # OpenAI's error shape
        "message": f"Conversation with id '{made.id}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": "conversation_not_found",
    }
    with pytest.raises(openai.NotFoundError):
        client.conversations.delete(made.id)  # once


def test_items_are_added_paged_read_and_deleted(server: Server, client: openai.OpenAI) -> None:
    made = client.conversations.create(
        items=[
            {"type": "message", "role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "What's the weather?"}]},
        ]
    )
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    raw = _raw(
        server,
        "POST",
        f"/conversations/{made.id}/items",
        json={
            "items": [
                call,
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                _message("assistant", "It is sunny."),
            ]
        },
    )
    assert raw.status_code == 200, raw.text
    added = ConversationItemList.model_validate(raw.json())
    assert [i.type for i in added.data] == ["function_call", "function_call_output", "message"]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    assert added.has_more is False

    every = _items(client, made.id)
    assert [i.type for i in every] == ["message", "message", *[i.type for i in added.data]]
    assert [getattr(i, "role", None) for i in every] == [
        "system", "user", None, None, "assistant"
    ]  # fmt: skip
    assert _text(every[1]) == "What's the weather?" and _text(every[4]) == "It is sunny."
    assert every[2].arguments == '{"city": "Paris"}'  # type: ignore[union-attr]
    # Each listed item as the SDK types it: messages with a status, output text annotated.
    page = _raw(server, "GET", f"/conversations/{made.id}/items", params={"order": "asc"}).json()
    for item in page["data"]:
        ITEM.validate_python(item)
    assert page["data"][4]["content"][0] == {
        "type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []
    }  # fmt: skip

    # Pages of two, newest first (the default), followed by the SDK from last_id.
    first = client.conversations.items.list(made.id, limit=2)
    assert [i.id for i in first.data] == [every[4].id, every[3].id] and first.has_more
    assert [i.id for i in client.conversations.items.list(made.id, limit=2)] == [
        i.id for i in reversed(every)
    ]
    second = client.conversations.items.list(made.id, limit=2, after=every[3].id)
    assert [i.id for i in second.data] == [every[2].id, every[1].id] and second.has_more
    asc = client.conversations.items.list(made.id, limit=3, order="asc", after=every[1].id)
    assert [i.id for i in asc.data] == [i.id for i in every[2:]] and not asc.has_more

    one = client.conversations.items.retrieve(every[2].id, conversation_id=made.id)
    assert one.id == every[2].id and one.type == "function_call"
    after = client.conversations.items.delete(every[2].id, conversation_id=made.id)
    Conversation.model_validate(after.model_dump())
    assert after.id == made.id
    assert [i.id for i in _items(client, made.id)] == [i.id for i in every if i != every[2]]
    with pytest.raises(openai.NotFoundError) as caught:
        client.conversations.items.retrieve(every[2].id, conversation_id=made.id)
    assert caught.value.code == "item_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.conversations.items.delete(every[2].id, conversation_id=made.id)
    assert caught.value.code == "item_not_found"


def test_items_are_checked_as_response_input_is(server: Server, client: openai.OpenAI) -> None:
    made = client.conversations.create()
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    call = {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": ""}
    new, add = "/conversations", f"/conversations/{made.id}/items"
    cases: list[tuple[str, dict[str, Any], str]] = [
        (new, {"items": [{"role": "user", "content": [image]}]}, "items[0].content[0].type"),
        (new, {"items": [{"type": "item_reference", "id": "x"}]}, "items[0].type"),
        (new, {"items": [_message("user", "x")] * 21}, "items"),
        (new, {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        (new, {"metadata": {"k": "v" * 513}}, "metadata.k"),
        (new, {"items": [call, call]}, "items"),
        (add, {"items": []}, "items"),
        (add, {"items": [{"role": "tool", "content": "x"}]}, "items[0].role"),
        (add, {"items": [call, call]}, "items"),
        (f"/conversations/{made.id}", {}, "metadata"),
    ]  # fmt: skip
    for path, body, param in cases:
        raw = _raw(server, "POST", path, json=body)
        assert raw.status_code == 400, (path, body, raw.text)
        error = raw.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["param"] == param, (body, error)
    # An id the conversation holds already, in a later request.
    assert _raw(
        server, "POST", f"/conversations/{made.id}/items", json={"items": [call]}
    ).is_success
    raw = _raw(server, "POST", f"/conversations/{made.id}/items", json={"items": [call]})
    assert raw.status_code == 400 and "fc_1" in raw.json()["error"]["message"]
    assert [i.id for i in _items(client, made.id)] == ["fc_1"]  # nothing else was stored
    long_id = "conv_" + "x" * 64
    assert _raw(server, "GET", f"/conversations/{long_id}").status_code == 400
    assert _raw(server, "GET", f"/conversations/{made.id}/items/{'x' * 65}").status_code == 400
    assert _raw(server, "GET", f"/conversations/{made.id}/items?limit=101").status_code == 400


def test_a_response_runs_on_the_conversation_and_appends_its_turn(
    server: Server, client: openai.OpenAI
) -> None:
    made = client.conversations.create(items=[_message("developer", "You are a weather bot.")])
    kwargs: dict[str, Any] = {
        "model": "demo", "max_output_tokens": 8, "temperature": 0, "extra_body": LONG
    }  # fmt: skip
    first = client.responses.create(conversation=made.id, input="Hello there", **kwargs)
    assert first.conversation is not None and first.conversation.id == made.id
    raw = _raw(server, "GET", f"/responses/{first.id}").json()
    assert raw["conversation"] == {"id": made.id}  # stored as it was answered
    Response.model_validate(raw)
    every = _items(client, made.id)
    assert [i.type for i in every] == ["message"] * 3
    assert [i.role for i in every] == ["developer", "user", "assistant"]  # type: ignore[union-attr]
    assert _text(every[1]) == "Hello there"
    # The output, as the response gave it (cut at max_output_tokens: `incomplete`).
    assert every[2].id == first.output[0].id and _text(every[2]) == first.output_text
    assert every[2].status == first.output[0].status == "incomplete"  # type: ignore[union-attr]

    # The second turn's prompt holds the first turn: it has grown by the first's input and
    # output, and is found in the prefix cache.
    second = client.responses.create(conversation={"id": made.id}, input="And tomorrow?", **kwargs)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert second.conversation is not None and second.conversation.id == made.id
    every = _items(client, made.id)
    assert len(every) == 5 and _text(every[3]) == "And tomorrow?"
    assert every[4].id == second.output[0].id

    # A streamed turn is appended before its last event.
    with client.responses.stream(conversation=made.id, input="Stream it", **kwargs) as stream:
        final = [e for e in stream][-1].response  # type: ignore[union-attr]
    every = _items(client, made.id)
    assert len(every) == 7 and every[6].id == final.output[0].id
    assert final.conversation is not None and final.conversation.id == made.id

    # A response without a conversation says nothing of one (as OpenAI's).
    plain = _raw(
        server, "POST", "/responses", json={"model": "demo", "input": "x", "max_output_tokens": 2}
    )
    assert "conversation" not in plain.json()
    # store: false keeps no response, but the conversation keeps the turn.
    unstored = client.responses.create(
        conversation=made.id, input="Off the record", store=False, **kwargs
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert _items(client, made.id)[-1].id == unstored.output[0].id


def test_a_background_turn_is_appended_when_it_finishes_and_a_cancelled_one_never(
    client: openai.OpenAI,
) -> None:
    made = client.conversations.create()
    done = client.responses.create(
        model="demo", input="quick", max_output_tokens=4, background=True, conversation=made.id,
        extra_body=LONG,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert polled.status == "incomplete"
    assert [i.id for i in _items(client, made.id)][-1] == polled.output[0].id

    held = [i.id for i in _items(client, made.id)]
    long = client.responses.create(
        model="demo", input="long", max_output_tokens=900, background=True, conversation=made.id,
        extra_body=LONG,
    )  # fmt: skip
    assert [i.id for i in _items(client, made.id)] == held  # nothing while it runs
    assert client.responses.cancel(long.id).status == "cancelled"
    assert [i.id for i in _items(client, made.id)] == held  # nor once cancelled


def test_a_turn_that_is_refused_appends_nothing(server: Server, client: openai.OpenAI) -> None:
    made = client.conversations.create(items=[_message("user", "Hi")])
    held = [i.id for i in _items(client, made.id)]
    previous = client.responses.create(model="demo", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="demo", input="y", conversation=made.id, previous_response_id=previous.id
        )
    assert caught.value.body["param"] == "conversation"  # type: ignore[index]
    assert "previous_response_id" in caught.value.message
    with pytest.raises(openai.NotFoundError) as caught_404:
        client.responses.create(model="demo", input="y", conversation=UNKNOWN)
    assert caught_404.value.body["param"] == "conversation"  # type: ignore[index]
    assert caught_404.value.code == "conversation_not_found"
    # Past the model's context: refused before it runs.
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="demo", input="word " * 2000, conversation=made.id)
    # An input item whose id the conversation holds: it could not be appended.
    call = {"type": "function_call", "id": "fc_dup", "call_id": "c", "name": "f", "arguments": "{}"}
    client.conversations.items.create(made.id, items=[call])  # type: ignore[list-item]
    held.append("fc_dup")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", input=[call], conversation=made.id)  # type: ignore[list-item]
    assert caught.value.body["param"] == "input"  # type: ignore[index]
    assert [i.id for i in _items(client, made.id)] == held
    assert server.wait_all_blocks_free()


def test_another_tenants_conversation_is_an_unknown_id_on_every_route(
    server: Server, client: openai.OpenAI
) -> None:
    mine = client.conversations.create(items=[_message("user", "secret")], metadata={"k": "v"})
    (item,) = _items(client, mine.id)
    _, key = new_tenant(server, "other-conversations")
    other = server.client(key)
    item_body = {"items": [_message("user", "x")]}
    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/conversations/{c}", None),
        ("POST", "/conversations/{c}", {"metadata": {"k": "stolen"}}),
        ("GET", "/conversations/{c}/items", None),
        ("POST", "/conversations/{c}/items", item_body),
        ("GET", "/conversations/{c}/items/{i}", None),
        ("DELETE", "/conversations/{c}/items/{i}", None),
        ("DELETE", "/conversations/{c}", None),
    ]

    def answers(conversation_id: str, who: str | None) -> list[tuple[int, str]]:
        found = []
        for method, path, body in routes:
            raw = _raw(server, method, path.format(c=conversation_id, i=item.id), who, json=body)
            found.append((raw.status_code, raw.text.replace(conversation_id, "ID")))
        return found

    theirs = answers(mine.id, key)
    assert all(status == 404 for status, _ in theirs)
    assert answers(UNKNOWN, key) == theirs  # the same bodies as for an id that never existed
    with pytest.raises(openai.NotFoundError) as caught:
        other.responses.create(model="demo", input="x", conversation=mine.id)
    assert caught.value.code == "conversation_not_found"
    # Nothing of it changed for its owner.
    assert client.conversations.retrieve(mine.id).metadata == {"k": "v"}
    assert [i.id for i in _items(client, mine.id)] == [item.id]
    # Once its owner deleted it, the owner hears what the other tenant heard.
    client.conversations.delete(mine.id)
    assert answers(mine.id, None) == theirs


def test_deleting_a_tenant_deletes_its_conversations(server: Server) -> None:
    tenant_id, key = new_tenant(server, "leaving-conversations")
    theirs = server.client(key)
    made = theirs.conversations.create(items=[_message("user", "bye"), _message("user", "now")])
    theirs.conversations.items.create(made.id, items=[_message("user", "later")])  # type: ignore[list-item]
    with admin_client(server) as admin:
        assert admin.delete(f"/admin/tenants/{tenant_id}").status_code == 204
    db = server.tenancy.tenancy.db

    async def counts() -> tuple[int, int]:
        async with db.session() as session:
            conversations = await session.scalar(
                select(func.count()).where(ConversationRow.tenant_id == tenant_id)
            )
            items = await session.scalar(
                select(func.count()).where(ConversationItemRow.conversation_id == made.id)
            )
        return conversations or 0, items or 0

    assert server.run(counts()) == (0, 0)
