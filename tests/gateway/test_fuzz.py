"""Property-based: hostile bodies for both routes, generated from their pydantic schemas, fired
at a live server while victims' requests run. Whatever a body holds, the answer is a 2xx or
4xx in OpenAI's shape (never a 5xx), every victim's output equals its output alone, and no
KV block leaks.

Each body takes some of the fields of CompletionRequest or ChatCompletionRequest with valid
values and up to three with hostile ones (extreme integers, non-finite floats, huge and empty
lists, deep nesting, random Unicode with lone surrogates and NUL, wrong types). CI runs a
fixed, derandomized set of LORAGATE_FUZZ_EXAMPLES bodies (about half a minute); set
LORAGATE_FUZZ_LONG=1 for a random, longer run.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from live_server import Server, build_test_app, live_server

from engine import EngineConfig
from engine.frontend.engine_process import EngineProcess
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "demo"
LONG = os.environ.get("LORAGATE_FUZZ_LONG") == "1"
EXAMPLES = int(os.environ.get("LORAGATE_FUZZ_EXAMPLES", "2000" if LONG else "150"))
ERROR_KEYS = {"message", "type", "param", "code"}

extreme_ints = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, -1, 2**31, 2**31 - 1, 2**63, 2**63 - 1, -(2**63) - 1, 2**64, 10**30]),
)
nasty_text = st.one_of(
    st.text(
        alphabet=st.one_of(
            st.characters(codec=None),  # any code point, lone surrogates included
            st.sampled_from(["\x00", "\ud800", "\udfff", "\ufffd", "\n"]),
        ),
        max_size=40,
    ),
    st.sampled_from(["<|im_end|>", "<|im_start|>user", "{{ raise_exception('x') }}"]),
)


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


hostile = st.one_of(
    extreme_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    nasty_text,
    st.none(),
    st.booleans(),
    st.just([]),
    st.just({}),
    st.integers(min_value=1, max_value=100_000).map(lambda n: [7] * n),  # huge lists
    st.integers(min_value=1, max_value=600).map(_nested),  # deep nesting
    st.dictionaries(nasty_text, extreme_ints, max_size=3),
    st.lists(extreme_ints, max_size=5),
)

clean_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": clean_text}
)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "prompt": st.one_of(
        clean_text, st.lists(st.integers(0, 8191), min_size=1, max_size=20), st.just(["a", "b"])
    ),
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(clean_text.filter(bool), st.lists(clean_text.filter(bool), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 8191), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 8191).map(str), st.floats(-100, 100), max_size=4),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 4),
    "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
    "top_logprobs": st.integers(0, 5),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "ignore_eos": st.booleans(),
    "user": clean_text,
    "guided_choice": st.lists(clean_text.filter(bool), min_size=1, max_size=3),
    "guided_regex": st.sampled_from(["[a-c]{1,3}", "(", "x*"]),
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}]
    ),
}


GUIDED = ("guided_choice", "guided_regex", "response_format")


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    schema = ChatCompletionRequest if chat else CompletionRequest
    fields = list(schema.model_fields)
    body: dict[str, Any] = {}
    guided = draw(st.sampled_from([None, *GUIDED]))  # two would be a 400 of its own
    for name in fields:
        if name in GUIDED and name != guided:
            continue
        if name in ("model", "prompt", "messages", guided) or (
            name in VALID and draw(st.booleans())
        ):
            body[name] = draw(VALID[name])
    # None in about half the bodies, so that those reach the engine; else one to three.
    num_hostile = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))
    for name in draw(st.lists(st.sampled_from(fields), min_size=num_hostile, unique=True))[
        :num_hostile
    ]:
        body[name] = draw(hostile)
    if draw(st.booleans()):
        body[draw(nasty_text)] = draw(hostile)  # an unknown field
    # Python writes NaN and Infinity (not JSON), and lone surrogates escaped or raw.
    text = json.dumps(body, allow_nan=True, ensure_ascii=draw(st.booleans()))
    route = "/v1/chat/completions" if chat else "/v1/completions"
    return route, text.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = EngineConfig(
        model=str(demo_model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=128,  # bounds any accepted request's work
        num_threads=1,
        guided_compile_timeout=2.0,
        dtype="float32",
    )
    engine = EngineProcess(config, max_waiting=256)
    engine.start()
    root = tmp_path_factory.mktemp("tenancy")
    app = build_test_app(engine, MODEL, root, demo_model_dir, max_body_bytes=1 << 20)
    with live_server(app, engine) as server:
        yield server
    asyncio.run(engine.shutdown(0))


VICTIMS = [
    {"model": MODEL, "prompt": "A victim", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Another victim"}],
        "max_tokens": 16,
        "temperature": 0.8,
        "seed": 11,
    },
]


def _victim_output(client: httpx.Client, body: dict) -> str:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = client.post(route, json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return str(choice["message"]["content"] if "messages" in body else choice["text"])


class Victims:
    """Victims' requests sent one after another, in a thread, until stopped."""

    def __init__(self, server: Server) -> None:
        self.client = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
        self.baseline = [_victim_output(self.client, body) for body in VICTIMS]
        self.outputs: list[tuple[int, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for i, body in enumerate(VICTIMS):
                self.outputs.append((i, _victim_output(self.client, body)))

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.client.close()


@pytest.fixture(scope="module")
def victims(server: Server) -> Iterator[Victims]:
    victims = Victims(server)
    yield victims
    victims.finish()
    assert victims.outputs, "no victim request ran beside the fuzzed ones"
    assert all(out == victims.baseline[i] for i, out in victims.outputs)
    assert server.wait_all_blocks_free()


def _check_answer(resp: httpx.Response) -> None:
    assert resp.status_code < 500, resp.text[:500]
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == ERROR_KEYS
        return
    if not resp.headers["content-type"].startswith("text/event-stream"):
        assert resp.json()["choices"]
        return
    lines = [line for line in resp.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert "choices" in chunk or set(chunk["error"]) == ERROR_KEYS


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not LONG,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=bodies())
def test_hostile_bodies_are_answered_alone(
    server: Server, victims: Victims, case: tuple[str, bytes]
) -> None:
    route, body = case
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client:
        resp = client.post(route, content=body, headers={"content-type": "application/json"})
        event(f"HTTP {resp.status_code}")  # pytest --hypothesis-show-statistics
        _check_answer(resp)
        assert client.get("/health").status_code == 200
