"""tool_choice "auto": each format's parser on recorded model outputs (malformed ones come
back as content), streaming every prefix, the grammar that holds a started call to its
tool's schema, and a live server with --tool-call-parser."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from live_server import Server, demo_server
from transformers import AutoConfig, AutoTokenizer

from engine import EngineConfig
from engine.request import GuidedSpec
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.tools.calls import ToolPlan, tool_plan
from gateway.openai.tools.parsers import FORMATS
from gateway.openai.tools.stream import ToolCallStream
from gateway.settings import Settings, SettingsError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def plan(parallel: bool = True) -> ToolPlan:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": MESSAGES,
            "tools": [WEATHER, ADD],
            "parallel_tool_calls": parallel,
        }
    )
    result = tool_plan(body, "hermes")
    assert result is not None and result.mode == "auto"
    return result


# format -> [(recorded output, content, [(name, arguments object)])]; None arguments: no calls
RECORDED: dict[str, list[tuple[str, str | None, list[tuple[str, Any]]]]] = {
    "hermes": [
        ("It is sunny.", "It is sunny.", []),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>',
            "Let me check.",
            [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})],
        ),
        # malformed: broken JSON, an unclosed call, a missing name
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": }}\n</tool_call>',
            '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": }}\n</tool_call>',
            [],
        ),
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 2',
            '<tool_call>\n{"name": "add", "arguments": {"a": 2',
            [],
        ),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
    ],
    "llama3_json": [
        ("Paris is sunny.", "Paris is sunny.", []),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "add", "arguments": {"a": 1, "b": 1}}',
            None,
            [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 1})],
        ),
        ('Say {"name": "add"}', 'Say {"name": "add"}', []),  # not at the start: text
        ('{"name": "add", "parameters": [1, 2', '{"name": "add", "parameters": [1, 2', []),
    ],
    "mistral": [
        ("Sunny.", "Sunny.", []),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
            None,
            [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
        ),
        (
            'Checking.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]',
            "Checking.",
            [("add", {"a": 1, "b": 2})],
        ),
        ('[TOOL_CALLS][{"name": 5}]', '[TOOL_CALLS][{"name": 5}]', []),
    ],
}
CASES = [(fmt, *case) for fmt, cases in RECORDED.items() for case in cases]
# Well-formed ones: a malformed call is streamed as a call until it breaks (the grammar keeps
# models from writing one), so only those add up.
WELL_FORMED = [c for c in CASES if c[3] or FORMATS[c[0]].trigger not in c[1]]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_recorded_outputs_parse_and_malformed_ones_are_content(
    fmt: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    got_content, got_calls = ToolCallStream(plan(), FORMATS[fmt]).final(text)
    assert got_content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls or []
    ] == calls
    assert all(c["id"].startswith("call_") for c in got_calls or [])


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), WELL_FORMED)
def test_streaming_every_prefix_adds_up_to_the_whole(
    fmt: str, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    stream = ToolCallStream(plan(), FORMATS[fmt])
    streamed_content = ""
    streamed: dict[int, list[str]] = {}
    for end in range(len(text) + 1):
        fragment, deltas = stream.deltas(text[:end], finished=end == len(text))
        streamed_content += fragment
        for delta in deltas:
            entry = streamed.setdefault(delta["index"], ["", ""])
            if "id" in delta:
                assert not entry[0]
                entry[0] = delta["function"]["name"]
            entry[1] += delta["function"].get("arguments", "")
    if calls:  # content before the calls streams as it settles; the calls, name first
        assert streamed_content.strip() == (content or "")
        assert [(n, json.loads(a)) for n, a in (streamed[i] for i in sorted(streamed))] == calls
    else:
        assert streamed_content == text  # all of it, held-back trigger prefixes included


def test_the_grammar_holds_a_started_call_to_its_schema(demo_model_dir: Path) -> None:
    from engine.llm_engine import grammar_cache
    from engine.models.llama import eos_token_ids

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    hf_config = AutoConfig.from_pretrained(demo_model_dir)
    eos = eos_token_ids(hf_config, tokenizer, str(demo_model_dir))
    cache = grammar_cache(
        EngineConfig(model=str(demo_model_dir)), tokenizer, hf_config.vocab_size, eos
    )
    tag = FORMATS["hermes"].structural_tag(plan(parallel=False))
    compiled = cache.submit(GuidedSpec(structural_tag=tag)).result(timeout=30)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled.grammar, terminate_without_stop_token=True)
        return matcher.accept_string(text)

    begin = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert accepts("Just text, no call.")
    assert accepts(f'Sure: {begin}{{"city": "Paris"}}}}\n</tool_call>')
    assert not accepts(f'{begin}{{"town": "Paris"}}')  # not its schema
    assert not accepts(f'{begin}{{"city": 5}}')
    assert not accepts('<tool_call>\n{"name": "rm_rf"')  # not a tool
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert not accepts(f'{begin}{{"city": "P"}}}}\n</tool_call>{add}')  # parallel off: one call


def test_auto_needs_a_parser() -> None:
    with pytest.raises(SettingsError, match="--tool-call-parser"):
        Settings(enable_auto_tool_choice=True).check_tool_choice()
    Settings(enable_auto_tool_choice=True, tool_call_parser="hermes").check_tool_choice()


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with demo_server(
        demo_model_dir, tmp_path_factory.mktemp("tenancy"), tool_call_parser="hermes"
    ) as server:
        yield server


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_in_text_when_the_model_calls_nothing(server: Server, stream: bool) -> None:
    """The demo model's random weights never write `<tool_call>`: the answer is text, whole or
    streamed, as without tools; tool_choice "required" on the same server still forces."""
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model="demo", messages=MESSAGES, tools=[WEATHER, ADD], max_tokens=12, temperature=0
    )
    plain = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=12, temperature=0
    )
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.tool_calls is None
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "length" and text and "<tool_call>" not in text
    assert plain.choices[0].message.content  # (a different prompt: the tools are in it)
    forced = client.chat.completions.create(
        **kwargs | {"tool_choice": "required", "max_tokens": 96}
    )
    assert forced.choices[0].finish_reason in ("tool_calls", "length")
