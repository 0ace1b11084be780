"""The Responses API's request and objects without a server (gateway.openai.responses): input items
as chat messages, the chat request a response runs as, refusals naming their field, and the
events a stream of chat chunks becomes, each checked against the openai SDK's own types."""

from __future__ import annotations

import json
from typing import Any

import openresponses_types
import pytest
from openai.types.responses import Response
from response_events import response_violations

from bench.open_responses_spec import sse_violations
from gateway.http.errors import APIError
from gateway.openai.protocol import FieldError
from gateway.openai.responses.events import EventStream, sse
from gateway.openai.responses.items import chat_messages
from gateway.openai.responses.objects import ResponseMeta, item_list, output_items, usage_body
from gateway.openai.responses.protocol import ResponsesRequest
from gateway.openai.responses.websocket import socket_error

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "demo", "input": "hi"} | fields)


def test_items_become_chat_messages_calls_joining_their_assistant_turn() -> None:
    request = _request(
        input=[
            {"role": "user", "content": "weather?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"P"}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city":"L"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        ]
    )
    items = request.input_items()
    assert all(item["id"] for item in items)
    assert chat_messages("be brief", items) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city":"P"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city":"L"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_the_chat_request_carries_tools_format_and_sampling() -> None:
    request = _request(
        tools=[{"type": "function", "name": "w", "parameters": SCHEMA}],
        tool_choice={"type": "function", "name": "w"},
        text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}},
        max_output_tokens=7,
        temperature=0.5,
        top_k=3,
        seed=11,
    )
    chat = request.chat_request([{"role": "user", "content": "hi"}])
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5
    assert chat.top_k == 3 and chat.seed == 11
    assert chat.tools is not None and chat.tools[0].function.strict is True  # the API's default
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "w"  # type: ignore[union-attr]
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert not chat.stream


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "refusal", "refusal": 5}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "", "name": "w", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"n": 2}, "n"),
        ({"background": True, "stream": True}, "stream"),
    ],
)
def test_what_cannot_be_served_is_refused_by_field(fields: dict[str, Any], param: str) -> None:
    request = _request(**fields)
    with pytest.raises(FieldError) as caught:
        request.check()
        request.input_items()
        request.chat_request([{"role": "user", "content": "x"}])
    assert caught.value.param == param


def test_a_stream_of_chat_chunks_becomes_openais_events() -> None:
    meta = ResponseMeta(
        "resp_1", _request(tools=[{"type": "function", "name": "w", "parameters": SCHEMA}])
    )
    stream = EventStream(meta)
    events = stream.start()
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Let me "}}]},
        {"choices": [{"index": 0, "delta": {"content": "check."}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "w", "arguments": '{"ci'},
                            }
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"P"}'}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
    ]
    for chunk in chunks:
        events += stream.chunk(chunk)
    usage = usage_body({"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14})
    closing, final = stream.finish("completed", usage)
    events += closing
    assert sse_violations("".join(sse(e) for e in events)) == []
    parsed = [json.loads(sse(e).split("data: ", 1)[1]) for e in events]  # JSON both ways
    assert parsed == events
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    assert [p["type"] for p in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert response_violations(final) == []
    response = Response.model_validate(final)
    assert response.output_text == "Let me check."
    call = response.output[1]
    assert (
        call.type == "function_call"
        and call.arguments == '{"city":"P"}'
        and call.call_id == "call_1"
    )
    # The same answer unstreamed has the same items.
    message = {
        "content": "Let me check.",
        "tool_calls": [{"id": "call_1", "function": {"name": "w", "arguments": '{"city":"P"}'}}],
    }
    whole = output_items({"message": message, "finish_reason": "tool_calls"})
    assert [(i["type"], i.get("arguments")) for i in whole] == [
        (i["type"], i.get("arguments")) for i in final["output"]
    ]


def test_input_items_are_paged_newest_first() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    page = item_list(items, "desc", 2, None)
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"]
    rest = item_list(items, "desc", 10, page["last_id"])
    assert [i["id"] for i in rest["data"]] == ["i2", "i1", "i0"] and not rest["has_more"]


def test_a_refusal_on_a_socket_is_the_specs_error_event() -> None:
    refused = APIError(
        429, "slow down", type="rate_limit_error", code="rate_limit_exceeded",
        headers={"Retry-After": "3"},
    )  # fmt: skip
    event = socket_error(refused)
    openresponses_types.WebSocketErrorEvent.model_validate(event)
    assert event["status"] == 429 and event["error"]["code"] == "rate_limit_exceeded"
    assert event["error"]["headers"] == {"Retry-After": "3"}  # as an HTTP answer carries it
