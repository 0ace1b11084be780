"""The safety net under guided JSON: finished documents checked against their schema.

Unit tests of gateway.openai.guided_validation, then the serving path end to end with the openai
client against a live server whose engine is wrapped so that it does not enforce `uniqueItems`
and enforces `oneOf` as `anyOf`, as a grammar engine that lets a keyword through would: the
documents it finishes fail their schema, and the gateway must say so.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Server, build_test_app, live_server, wait_for_usage

from engine import EngineConfig, LLMEngine
from engine.frontend.async_engine import AsyncEngine
from engine.messages import EngineRequest
from engine.request import GuidedSpec
from gateway.openai import guided_validation
from gateway.openai.guided_validation import OutputValidator, checks

MODEL = "demo"
UNIQUE = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"const": "a"},
            "minItems": 2,
            "maxItems": 2,
            "uniqueItems": True,
        }
    },
    "required": ["tags"],
    "additionalProperties": False,
}
# Both branches hold every value the grammar allows: exactly-one can never hold.
ONE_OF = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"enum": [0, 1, 2, 3]}]}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}


def schema_spec(schema: dict[str, Any]) -> GuidedSpec:
    return GuidedSpec(json_schema=schema)


# -- the validator ----------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "kind": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
        "day": {"type": "string", "format": "date"},
        "mail": {"type": "string", "format": "email"},
        "n": {"type": "integer", "maximum": 5},
        "a/b": {"type": "string"},
        "at": {"type": "string", "format": "date-time"},
        "url": {"type": "string", "format": "uri"},
        "host": {"type": "string", "format": "hostname"},
        "version": {"type": "string", "pattern": "^(?<major>0|[1-9][0-9]*)\\.(?<minor>[0-9]+)$"},
        "env": {"type": "object", "patternProperties": {"^(?<name>[A-Z_]+)$": {"type": "string"}}},
    },
    "required": ["tags"],
    "additionalProperties": False,
}

# (document, keyword, JSON pointer into the document, JSON pointer into the schema)
INVALID = [
    ('{"tags":["x","x"]}', "uniqueItems", "/tags", "/properties/tags/uniqueItems"),
    ('{"tags":[],"kind":3}', "oneOf", "/kind", "/properties/kind/oneOf"),
    ('{"tags":[],"kind":-1.5}', "oneOf", "/kind", "/properties/kind/oneOf"),
    ('{"tags":[],"day":"2024-02-30"}', "format", "/day", "/properties/day/format"),
    ('{"tags":[],"mail":"nobody"}', "format", "/mail", "/properties/mail/format"),
    ('{"tags":[],"n":6}', "maximum", "/n", "/properties/n/maximum"),
    ('{"tags":[],"a/b":1}', "type", "/a~1b", "/properties/a~1b/type"),
    ('{"tags":[],"other":1}', "additionalProperties", "", "/additionalProperties"),
    ('{"tags":[],"at":"2024-02-01 noon"}', "format", "/at", "/properties/at/format"),
    ('{"tags":[],"url":"not a uri"}', "format", "/url", "/properties/url/format"),
    ('{"tags":[],"host":"-bad-.example"}', "format", "/host", "/properties/host/format"),
    ('{"tags":[],"version":"01.2"}', "pattern", "/version", "/properties/version/pattern"),
    (
        '{"tags":[],"env":{"HOME":1}}',
        "type",
        "/env/HOME",
        "/properties/env/patternProperties/^(?<name>[A-Z_]+)$/type",
    ),
    ("{}", "required", "", "/required"),
]


@pytest.mark.parametrize(("text", "keyword", "pointer", "schema_pointer"), INVALID)
def test_each_failing_keyword_is_named_with_its_pointers(
    text: str, keyword: str, pointer: str, schema_pointer: str
) -> None:
    violation = OutputValidator().validate(schema_spec(SCHEMA), text)
    assert violation is not None
    assert (violation.keyword, violation.pointer, violation.schema_pointer) == (
        keyword,
        pointer,
        schema_pointer,
    )
    assert keyword in violation.message and (pointer or "/") in violation.message
    assert violation.body() == {
        "message": violation.message,
        "type": "invalid_output",
        "param": None,
        "code": "schema_validation_failed",
    }


@pytest.mark.parametrize(
    "text",
    [
        '{"tags":[]}',
        '{"tags":["x","y"],"kind":1.5,"day":"2024-02-29","mail":"a@b.c","n":5,"a/b":"z"}',
        '{"tags":[],"at":"2024-02-01T12:00:00Z","url":"https://x.org/a?b","host":"a.example",'
        '"version":"1.20","env":{"HOME":"/root","lower":1}}',
        ' {"tags":["x"]}\n',
    ],
)
def test_a_valid_document_passes(text: str) -> None:
    assert OutputValidator().validate(schema_spec(SCHEMA), text) is None


@pytest.mark.parametrize("text", ['{"tags":["x"', "", '{"tags":[]} x', '{"tags":[NaN]}'])
def test_not_json_fails_as_json(text: str) -> None:
    violation = OutputValidator().validate(schema_spec(SCHEMA), text)
    assert violation is not None and violation.keyword == "json"
    assert violation.message.startswith("the output is not valid JSON")


def test_json_object_mode_wants_an_object() -> None:
    spec = GuidedSpec(json_object=True)
    validator = OutputValidator()
    assert validator.validate(spec, '{"a":[1,2,{}]}') is None
    for text, kind in [("[1]", "array"), ('"s"', "string"), ("3", "number"), ("null", "null")]:
        violation = validator.validate(spec, text)
        assert violation is not None and violation.keyword == "type"
        assert violation.message == f"the output is a JSON {kind}, not an object"
    truncated = validator.validate(spec, '{"a":')
    assert truncated is not None and truncated.keyword == "json"


def test_the_schema_s_own_draft_is_used() -> None:
    # Draft 4: exclusiveMaximum is a boolean beside maximum; 2020-12 would call it invalid.
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "integer",
        "maximum": 5,
        "exclusiveMaximum": True,
    }
    validator = OutputValidator()
    assert validator.validate(schema_spec(draft4), "4") is None
    violation = validator.validate(schema_spec(draft4), "5")
    assert violation is not None and violation.keyword == "maximum"
    # 2020-12 (the default): prefixItems; items: false forbids more.
    tuple_schema = {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}
    assert validator.validate(schema_spec(tuple_schema), "[1]") is None
    assert validator.validate(schema_spec(tuple_schema), "[1,2]") is not None


def test_validators_are_cached_by_canonical_schema_in_an_lru() -> None:
    validator = OutputValidator(cache_size=2)
    a = {"type": "object", "properties": {"x": {"type": "integer"}}}
    same_as_a = {"properties": {"x": {"type": "integer"}}, "type": "object"}
    b, c = {"type": "array"}, {"type": "string"}
    first = validator._validator(a)
    assert validator._validator(same_as_a) is first
    validator._validator(b)
    validator._validator(a)  # a is now the most recent: b goes first
    validator._validator(c)
    assert len(validator._validators) == 2
    assert validator._validator(same_as_a) is first
    assert validator._validator(b) is not None and len(validator._validators) == 2


def test_large_documents_are_checked_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    offloaded: list[int] = []
    real = asyncio.to_thread

    async def to_thread(func: Any, *args: Any) -> Any:
        offloaded.append(len(args[1]))
        return await real(func, *args)

    monkeypatch.setattr(guided_validation.asyncio, "to_thread", to_thread)
    validator = OutputValidator(offload_chars=100)
    spec = schema_spec({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    small, large = "[1,2]", json.dumps(list(range(100)) + [0])
    assert asyncio.run(validator.check(spec, small)) is None
    violation = asyncio.run(validator.check(spec, large))
    assert violation is not None and violation.keyword == "uniqueItems"
    assert offloaded == [len(large)]


def test_only_json_specs_are_checked() -> None:
    assert checks(schema_spec(POINT)) and checks(GuidedSpec(json_object=True))
    assert not checks(None)
    assert not checks(GuidedSpec(regex="a+"))
    assert not checks(GuidedSpec(choice=("a", "b")))
    assert not checks(GuidedSpec(grammar='root ::= "a"'))


# -- through the server -----------------------------------------------------------------------


def _unenforced(schema: Any) -> Any:
    """The schema as a lax grammar engine would enforce it: `oneOf` as `anyOf`, no
    `uniqueItems`."""
    if isinstance(schema, list):
        return [_unenforced(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "uniqueItems":
            continue
        out["anyOf" if key == "oneOf" else key] = _unenforced(value)
    return out


class UnenforcingEngine:
    """The real engine, compiling and decoding a relaxed copy of each JSON schema, so that what
    it finishes may fail the schema the client sent (which the gateway checks against)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @staticmethod
    def _relax(spec: GuidedSpec) -> GuidedSpec:
        if spec.json_schema is None:
            return spec
        return dataclasses.replace(spec, json_schema=_unenforced(copy.deepcopy(spec.json_schema)))

    async def compile_grammar(self, spec: GuidedSpec) -> Any:
        return await self._engine.compile_grammar(self._relax(spec))

    def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        params = request.params
        if params.guided is not None:
            params = dataclasses.replace(params, guided=self._relax(params.guided))
        return self._engine.generate(dataclasses.replace(request, params=params))


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = EngineConfig(
        model=str(demo_model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=512,
        num_threads=1,  # see tests/engine/guided/test_guided.py, dtype="float32"
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=64)
    engine.start()
    root = tmp_path_factory.mktemp("tenancy")
    app = build_test_app(UnenforcingEngine(engine), MODEL, root, demo_model_dir)  # type: ignore[arg-type]
    with live_server(app, engine) as server:
        yield server


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}


def invalid_count(server: Server, keyword: str) -> float:
    metrics = httpx.get(f"{server.base_url}/metrics").text
    found = re.search(
        rf'^loragate:guided_invalid_outputs_total\{{keyword="{keyword}"\}} (\S+)$', metrics, re.M
    )
    return float(found.group(1)) if found else 0.0


def usage_row(server: Server, request_id: str) -> dict[str, Any]:
    database_url = str(server.tenancy.settings.database_url)
    (row,) = wait_for_usage(database_url, 1, request_id=request_id)
    return row


def assert_failed(choice: Any, keyword: str, pointer: str) -> None:
    assert choice.finish_reason == "error"
    error = choice.model_extra["error"]
    assert error["type"] == "invalid_output" and error["code"] == "schema_validation_failed"
    assert f"{keyword} failed at {pointer}" in error["message"]


def test_an_unenforced_keyword_is_an_error_whole_and_streamed(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    client = server.client()
    before = invalid_count(server, "uniqueItems")
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Two tags"}],
        max_tokens=64,
        temperature=0,
        response_format=response_format(UNIQUE),
    )
    with caplog.at_level("WARNING", logger="gateway.openai.output_checks"):
        whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("keyword uniqueItems at '/tags'" in m for m in logged), logged
    assert_failed(choice, "uniqueItems", "/tags")
    assert json.loads(choice.message.content) == {"tags": ["a", "a"]}  # the text is kept
    # Billed as generated: the row is ok, with the engine's own finish reason.
    row = usage_row(server, whole.id)
    assert row["status"] == "ok" and row["finish_reason"] == "stop"
    assert row["completion_tokens"] == whole.usage.completion_tokens > 0

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert_failed(finals[0], "uniqueItems", "/tags")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].usage is not None  # the stream ends as usual
    assert usage_row(server, chunks[0].id)["status"] == "ok"
    assert invalid_count(server, "uniqueItems") == before + 2
    assert server.wait_all_blocks_free()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_every_sample_is_checked_on_completions(server: Server, stream: bool) -> None:
    before = invalid_count(server, "oneOf")
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        prompt="A number:",
        n=2,
        max_tokens=16,
        temperature=1.0,
        seed=3,
        extra_body={"guided_json": ONE_OF},
    )
    resp = server.client().completions.create(**kwargs, stream=stream)
    if stream:
        finals = {c.index: c for chunk in resp for c in chunk.choices if c.finish_reason}
    else:
        finals = {c.index: c for c in resp.choices}
    assert sorted(finals) == [0, 1]
    for choice in finals.values():
        assert_failed(choice, "oneOf", "/")
    assert invalid_count(server, "oneOf") == before + 2


def test_length_and_valid_outputs_are_answered_as_before(server: Server) -> None:
    client = server.client()
    cut = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Two tags"}],
        max_tokens=3,
        temperature=0,
        response_format=response_format(UNIQUE),
    )
    assert cut.choices[0].finish_reason == "length"
    assert "error" not in (cut.choices[0].model_extra or {})
    valid = client.completions.create(
        model=MODEL,
        prompt="A point:",
        max_tokens=32,
        temperature=0,
        extra_body={"response_format": response_format(POINT)},
    )
    assert valid.choices[0].finish_reason == "stop"
    assert "error" not in (valid.choices[0].model_extra or {})
    assert json.loads(valid.choices[0].text)["x"] in range(10)
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_client_stop_string_is_not_checked(server: Server) -> None:
    # The document is cut by the client's own stop string: incomplete, as with max_tokens.
    before = invalid_count(server, "json")
    resp = server.client().completions.create(
        model=MODEL,
        prompt="Two tags",
        max_tokens=64,
        temperature=0,
        stop=['"a"'],
        extra_body={"guided_json": UNIQUE},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert "error" not in (resp.choices[0].model_extra or {})
    assert invalid_count(server, "json") == before
