"""Guided decoding through the server: the official openai client against a live loragate."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from live_server import Server, build_test_app, live_server, register_public

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.request import GuidedSpec

MODEL = "demo"
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9},
        "label": {"enum": ["start", "end"]},
    },
    "required": ["x", "y", "label"],
    "additionalProperties": False,
}
MAX_SCHEMA_BYTES = 4096
MAX_SCHEMA_DEPTH = 12


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = EngineConfig(
        model=str(demo_model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=512,
        num_threads=1,  # see tests/engine/guided/test_guided.py
        guided_max_schema_bytes=MAX_SCHEMA_BYTES,
        guided_max_schema_depth=MAX_SCHEMA_DEPTH,
        dtype="float32",
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=64)
    engine.start()
    app = build_test_app(engine, MODEL, tmp_path_factory.mktemp("tenancy"), demo_model_dir)
    with live_server(app, engine) as server:
        yield server


def json_schema_format(schema: dict[str, Any], strict: bool | None = True) -> dict[str, Any]:
    body: dict[str, Any] = {"name": "point", "schema": schema}
    if strict is not None:
        body["strict"] = strict
    return {"type": "json_schema", "json_schema": body}


def test_chat_json_schema_validates_streamed_or_not(server: Server) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Where does the path start?"}],
        max_tokens=64,
        temperature=0,
        response_format=json_schema_format(POINT),
    )
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), POINT)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert server.wait_all_blocks_free()


def test_n_samples_each_validate(server: Server) -> None:
    resp = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Two points, please."}],
        n=3,
        max_tokens=64,
        temperature=1.0,
        seed=4,
        response_format=json_schema_format(POINT, strict=None),
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), POINT)


def test_json_object_on_both_routes(server: Server) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=8,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = client.completions.create(
        model=MODEL,
        prompt="JSON please",
        max_tokens=8,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    for content in (chat.choices[0].message.content, text.choices[0].text):
        assert content.startswith('{"')


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_vllm_guided_extras_on_both_routes(server: Server, chat: bool) -> None:
    client = server.client()
    cases = [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"guided_choice": ["left", "right", "up"]}, lambda t: t in ("left", "right", "up")),
        (
            {"guided_grammar": 'root ::= "(" [a-c] [a-c]? [a-c]? ")"'},  # ends: any seed stops
            lambda t: re.fullmatch(r"\([a-c]+\)", t),
        ),
        ({"guided_json": json.dumps(POINT)}, lambda t: jsonschema.validate(json.loads(t), POINT)),
    ]
    for extra, check in cases:
        kwargs: dict[str, Any] = dict(
            model=MODEL, max_tokens=48, temperature=0.7, seed=1, extra_body=extra
        )
        if chat:
            resp = client.chat.completions.create(
                messages=[{"role": "user", "content": "Answer:"}], **kwargs
            )
            text = resp.choices[0].message.content
        else:
            resp = client.completions.create(prompt="Answer:", **kwargs)
            text = resp.choices[0].text
        assert resp.choices[0].finish_reason == "stop", (extra, text)
        assert check(text) is not False, (extra, text)
    assert server.wait_all_blocks_free()


def deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def rf(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": json_schema_format(schema)}


# (extra body fields, the error's param, words in its message)
BAD = [
    (rf({"type": "frobnicate"}), "response_format", "invalid JSON schema"),
    (rf({"not": {"type": "integer"}}), "response_format", "at /not/type"),
    (rf({"$ref": "https://example.com/s.json"}), "response_format", "$ref"),
    (
        rf({"enum": [f"value number {i}" for i in range(400)]}),
        "response_format",
        f"the limit is {MAX_SCHEMA_BYTES}",
    ),
    (rf(deep(MAX_SCHEMA_DEPTH)), "response_format", f"the limit is {MAX_SCHEMA_DEPTH}"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": POINT}}},
        "response_format.json_schema.name",
        "",
    ),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a(b"}, "guided_regex", "cannot compile the regex"),
    ({"guided_regex": r"(a)\1"}, "guided_regex", "Backreference"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "cannot compile the grammar"),
    ({"guided_grammar": 'root ::= ""'}, "guided_grammar", "only the empty string"),
    ({"guided_json": POINT, "guided_regex": "a+"}, "guided_regex", "send one"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("extra", "param", "words"), BAD, ids=[p for _, p, _ in BAD])
def test_bad_specs_answer_400_before_anything_streams(
    server: Server, extra: dict[str, Any], param: str, words: str, stream: bool
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": stream, **extra}
    resp = httpx.post(
        f"{server.base_url}/v1/completions", headers=server.headers, json=body, timeout=60
    )
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"] and "/project/cpp" not in error["message"]
    assert server.wait_all_blocks_free()


def test_a_compile_past_the_timeout_is_400_and_the_engine_keeps_serving(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammars = server.engine.engine.grammars
    release = threading.Event()
    real = grammars._compile_unchecked

    def held(spec: GuidedSpec) -> Any:
        release.wait(60)
        return real(spec)

    monkeypatch.setattr(grammars, "_compile_unchecked", held)
    monkeypatch.setattr(grammars, "compile_timeout", 0.2)
    client = server.client()
    try:
        resp = httpx.post(
            f"{server.base_url}/v1/completions",
            headers=server.headers,
            json={"model": MODEL, "prompt": "x", "guided_regex": "slow[0-9]+"},
            timeout=60,
        )
        assert resp.status_code == 400
        assert "did not compile within 0.2 s" in resp.json()["error"]["message"]
        assert resp.json()["error"]["param"] == "guided_regex"
        plain = client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        assert plain.usage.completion_tokens == 4
    finally:
        release.set()
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_text_response_format_is_unguided(server: Server) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    plain = client.chat.completions.create(**kwargs)
    text = client.chat.completions.create(**kwargs, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_json_schema_under_an_adapter_streams_and_matches_the_offline_engine(
    demo_model_dir: Path, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    registry.register("r8-all", demo_adapters["r8-all"])
    config = EngineConfig(
        model=str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=256, dtype="float32"
    )
    engine = AsyncEngine(LLMEngine(config, lora_loader=registry.load), max_waiting=16)
    engine.start()
    prompt = [5, 77, 301, 1200, 42, 9, 640]
    app = build_test_app(engine, MODEL, tmp_path, demo_model_dir)
    register_public(app, "r8-all", demo_adapters["r8-all"])
    with live_server(app, engine) as server:
        chunks = list(
            server.client().completions.create(
                model="r8-all",
                prompt=prompt,
                n=2,
                max_tokens=64,
                temperature=0,
                stream=True,
                extra_body={"guided_json": POINT},
            )
        )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    offline = LLM(
        str(demo_model_dir), kv_cache_memory=32 << 20, lora_loader=registry.load, dtype="float32"
    )
    params = SamplingParams(temperature=0, max_tokens=64, guided=GuidedSpec(json_schema=POINT))
    expected = offline.generate([prompt], params, lora_request=registry.get("r8-all"))[0]
    assert texts == [expected.outputs[0].text] * 2
    jsonschema.validate(json.loads(texts[0]), POINT)
