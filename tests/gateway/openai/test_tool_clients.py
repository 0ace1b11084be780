"""Tool calling through the clients agent frameworks use, against a live loragate (demo model):
LangChain's ChatOpenAI (bind_tools, streaming, with_structured_output) and LiteLLM."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import reduce
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from live_server import Server, demo_server
from tool_schemas import WEATHER

# LiteLLM reads its model price map from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

SCHEMA = WEATHER["function"]["parameters"]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with demo_server(demo_model_dir, tmp_path_factory.mktemp("tenancy")) as server:
        yield server


def chat_openai(server: Server) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="demo",
        base_url=f"{server.base_url}/v1",
        api_key=server.tenancy.api_key,
        temperature=0,
        max_tokens=96,
        max_retries=0,
    )


@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_langchain_bind_tools_invoked_and_streamed(server: Server, tool_choice: str) -> None:
    llm = chat_openai(server).bind_tools(
        [WEATHER], tool_choice=tool_choice, parallel_tool_calls=False
    )
    message = llm.invoke(QUESTION)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], SCHEMA)
    streamed = reduce(lambda a, b: a + b, llm.stream(QUESTION))
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


def test_langchain_structured_output_by_function_calling(server: Server) -> None:
    structured = chat_openai(server).with_structured_output(
        SCHEMA | {"title": "weather"}, method="function_calling"
    )
    result = structured.invoke(QUESTION)
    jsonschema.validate(result, SCHEMA)


def test_litellm_forced_call_whole_and_streamed(server: Server) -> None:
    import litellm

    kwargs: dict[str, Any] = dict(
        model="openai/demo",
        api_base=f"{server.base_url}/v1",
        api_key=server.tenancy.api_key,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    )
    whole = litellm.completion(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    chunks = list(litellm.completion(**kwargs, stream=True))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=kwargs["messages"])
    [again] = rebuilt.choices[0].message.tool_calls
    assert (again.function.name, again.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
