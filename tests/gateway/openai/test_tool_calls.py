"""Tool calling: forced calls (`tool_choice` "required" or named) through the official openai
client against a live loragate on the demo model and on SmolLM2, streamed and whole; the
prompt rendering of tools, past calls and tool results; refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from live_server import Server, build_test_app, demo_server, live_server, register_public
from tool_schemas import ADD, NO_ARGS, WEATHER
from transformers import AutoTokenizer

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import EngineConfig, LLMEngine
from engine.frontend.async_engine import AsyncEngine
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.tools.calls import tool_plan
from gateway.openai.tools.parsers import FORMATS
from gateway.openai.tools.prompt import INSTRUCTIONS, render_messages
from gateway.openai.tools.stream import ToolCallStream

HERMES = FORMATS["hermes"]

MODEL = "demo"
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in (WEATHER, ADD, NO_ARGS)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}]


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with demo_server(demo_model_dir, tmp_path_factory.mktemp("tenancy")) as server:
        yield server


def check_calls(calls: Any, names: set[str] | None = None) -> list[tuple[str, Any]]:
    """Each call's arguments parse and validate against its function's schema."""
    assert calls
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        schema = SCHEMAS[call.function.name] or {"type": "object", "properties": {}}
        jsonschema.validate(arguments, schema)
        out.append((call.function.name, arguments))
    if names is not None:
        assert {name for name, _ in out} <= names
    return out


def test_a_named_function_is_called_with_valid_arguments(server: Server) -> None:
    resp = server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=64,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [(name, _)] = check_calls(choice.message.tool_calls)
    assert name == "add"
    assert resp.usage.completion_tokens > 0
    assert server.wait_all_blocks_free()


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_validate_one_or_several(server: Server, parallel: bool) -> None:
    resp = server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, ADD, NO_ARGS],
        tool_choice="required",
        parallel_tool_calls=parallel,
        n=4,
        max_tokens=160,
        temperature=1.0,
        seed=7,
    )
    finished = 0
    for choice in resp.choices:
        if choice.finish_reason == "length":  # random weights may ramble; never invalid
            continue
        assert choice.finish_reason == "tool_calls"
        calls = check_calls(choice.message.tool_calls, {"get_weather", "add", "now"})
        assert len(calls) == 1 or parallel
        finished += 1
    assert finished >= 2


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_reassemble_to_the_whole_message(server: Server, tool_choice: Any) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, ADD],
        tool_choice=tool_choice,
        max_tokens=96,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = streamed.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
            if delta.id:  # id, type and name come first, once
                assert not call["id"] and delta.function.name
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The openai client's own stream helper reassembles them too.
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == expected
    assert server.wait_all_blocks_free()


def test_a_conversation_with_tool_results_goes_on(server: Server) -> None:
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    calls = first.choices[0].message.tool_calls
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'} for c in calls),
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [WEATHER]}, "tool_choice", 'tool_choice "auto"'),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "names 'x', which is not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "no tools given"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools[1].function.name", "two"),
        (
            {
                "tools": [WEATHER, ADD],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "both constrain the output",
        ),
        (
            {
                "tools": [
                    WEATHER,
                    {
                        "type": "function",
                        "function": {
                            "name": "bad",
                            "parameters": {"properties": {"x": {"$ref": "https://x.org/s"}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            "at /properties/x/$ref: external reference",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            None,
            "",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    server: Server, extra: dict[str, Any], param: str | None, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=extra
        )
    error = refused.value.body
    assert isinstance(error, dict)
    if param is not None:
        assert error["param"] == param, error
    assert words in error["message"]


# -- the pieces, without a server ---------------------------------------------------------------


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES} | fields)


def test_partial_outputs_stream_the_calls_they_hold() -> None:
    plan = tool_plan(request(tools=[WEATHER, ADD], tool_choice="required"), None)
    assert plan is not None
    text = (
        '[{"name":"get_weather","parameters":{"city":"P\\"a,r}is","unit":"celsius"}},'
        '{"name":"add","parameters":{"a":2,"b":3}}]'
    )
    stream = ToolCallStream(plan)
    deltas = [d for end in range(len(text) + 1) for d in stream.deltas(text[:end], False)[1]]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        entry = calls.setdefault(delta["index"], ["", ""])
        if "id" in delta:
            entry[0] = delta["function"]["name"]
        entry[1] += delta["function"].get("arguments", "")
    content, whole = ToolCallStream(plan).final(text)
    assert content is None and whole is not None
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole
    ]
    assert json.loads(whole[0]["function"]["arguments"])["city"] == 'P"a,r}is'
    assert ToolCallStream(plan).final(text[:-12]) == (text[:-12], None)  # cut short


def test_tools_reach_a_template_that_does_not_know_them_as_a_system_message(
    demo_model_dir: Path,
) -> None:
    body = request(
        tools=[WEATHER],
        tool_choice="none",
        messages=[
            {"role": "system", "content": "Be brief."},
            *MESSAGES,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "5"},
        ],
    )
    messages, tools = render_messages(body.messages, tool_plan(body, None), HERMES, None)
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert INSTRUCTIONS.split("{tools}")[0].strip() in messages[0]["content"]
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
    }
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n5\n</tool_response>",
    }
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    assert "<tool_response>" in tokenizer.apply_chat_template(messages, tokenize=False)


# A template that knows tools, in the style of Qwen2.5's.
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}{% if m.role == 'tool' %}({{ m.name }} {{ m.tool_call_id }}){% endif %}\n"
    "{% endfor %}"
)


def test_a_template_that_knows_tools_gets_them_as_they_are(demo_model_dir: Path) -> None:
    body = request(
        tools=[WEATHER, ADD],
        tool_choice="required",
        messages=[
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_9", "content": "3 C"},
        ],
    )
    messages, tools = render_messages(body.messages, tool_plan(body, None), HERMES, NATIVE_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    text = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=NATIVE_TEMPLATE, tokenize=False
    )
    assert text.startswith("TOOLS:get_weather;add;")  # HF trims the newlines
    assert "assistant:[call get_weather Oslo]" in text
    assert "tool:3 C(get_weather call_9)" in text
    # Mistral's templates want ids of 9 letters or digits: the same call, shortened alike.
    mistral, _ = render_messages(
        body.messages, tool_plan(body, None), FORMATS["mistral"], NATIVE_TEMPLATE
    )
    assert mistral[1]["tool_calls"][0]["id"] == mistral[2]["tool_call_id"] == "00000call9"[-9:]


# -- a real model ----------------------------------------------------------------------------------


@pytest.mark.smollm2
def test_smollm2_forced_calls_validate(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = EngineConfig(
        model=str(smollm2_dir), kv_cache_memory=128 << 20, max_model_len=2048, dtype="float32"
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=16)
    engine.start()
    app = build_test_app(engine, "smollm2", tmp_path_factory.mktemp("tenancy"), smollm2_dir)
    with live_server(app, engine) as server:
        client = server.client()
        for tool_choice in ("required", {"type": "function", "function": {"name": "add"}}):
            resp = client.chat.completions.create(
                model="smollm2",
                messages=MESSAGES,
                tools=[WEATHER, ADD],
                tool_choice=tool_choice,
                max_tokens=96,
                temperature=0,
            )
            choice = resp.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            check_calls(choice.message.tool_calls, {"get_weather", "add"})


def test_forced_calls_under_an_adapter_with_the_prefix_cache(
    demo_model_dir: Path, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A tenant's adapter calls tools as the base does; the second identical request reads
    its prompt (tools included) from the prefix cache."""
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    registry.register("r8-all", demo_adapters["r8-all"])
    config = EngineConfig(
        model=str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=1024, dtype="float32"
    )
    engine = AsyncEngine(LLMEngine(config, lora_loader=registry.load), max_waiting=16)
    engine.start()
    app = build_test_app(engine, MODEL, tmp_path, demo_model_dir)
    register_public(app, "r8-all", demo_adapters["r8-all"])
    with live_server(app, engine) as server:
        kwargs: dict[str, Any] = dict(
            messages=MESSAGES,
            tools=[WEATHER, ADD],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64,
            temperature=0,
        )
        runs = [server.client().chat.completions.create(model=m, **kwargs) for m in ("r8-all",) * 2]
        for resp in runs:
            assert resp.choices[0].finish_reason == "tool_calls"
            check_calls(resp.choices[0].message.tool_calls, {"get_weather"})
        assert runs[1].usage.prompt_tokens_details.cached_tokens > 0
        assert server.wait_all_blocks_free()
