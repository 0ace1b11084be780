"""Two base models behind one gateway: SmolLM2 and the demo model, each with its own engine,
tokenizer, vocabulary and chat template; a request's `model` picks its engine, and each model
answers greedy exactly as its engine does alone."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import Server, build_test_app, live_server, usage_rows

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.offline import LLM

pytestmark = pytest.mark.smollm2

# Each model's engine as the server runs it, and as the reference runs it alone.
CONFIGS = {
    "demo": {"kv_cache_memory": 32 << 20, "max_model_len": 512, "dtype": "float32"},
    "smollm2": {"kv_cache_memory": 64 << 20, "max_model_len": 1024, "dtype": "float32"},
}


@pytest.fixture(scope="module")
def dirs(demo_model_dir: Path, smollm2_dir: Path) -> dict[str, Path]:
    return {"demo": demo_model_dir, "smollm2": smollm2_dir}


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    engines = {
        name: AsyncEngine(
            LLMEngine(EngineConfig(model=str(dirs[name]), num_threads=1, **CONFIGS[name]))
        )
        for name in CONFIGS
    }
    for engine in engines.values():
        engine.start()
    root = tmp_path_factory.mktemp("two-models")
    app = build_test_app(
        engines["demo"], "demo", root, dirs["demo"], more_models={"smollm2": engines["smollm2"]}
    )
    with live_server(app, engines["demo"]) as live:
        yield live
    for engine in engines.values():
        asyncio.run(engine.shutdown(0))


@pytest.fixture(scope="module")
def alone(dirs: dict[str, Path]) -> dict[str, LLM]:
    return {name: LLM(str(dirs[name]), num_threads=1, **CONFIGS[name]) for name in CONFIGS}


def test_models_lists_both_bases(server: Server) -> None:
    listed = {m.id: m for m in server.client().models.list().data}
    assert set(listed) == {"demo", "smollm2"}
    assert all(m.model_extra["parent"] is None for m in listed.values())
    assert listed["demo"].model_extra["max_model_len"] == CONFIGS["demo"]["max_model_len"]
    assert listed["smollm2"].model_extra["max_model_len"] == CONFIGS["smollm2"]["max_model_len"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_model_answers_as_its_engine_alone(
    server: Server, alone: dict[str, LLM], name: str
) -> None:
    client = server.client()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    completion = client.completions.create(
        model=name,
        prompt="The cat sat on the",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ref = alone[name].generate(["The cat sat on the"], greedy)[0]
    assert completion.model == name
    assert completion.choices[0].text == ref.outputs[0].text
    assert completion.usage.prompt_tokens == len(ref.prompt_token_ids)

    # A chat goes through this model's own template and tokenizer.
    question = "Name a colour."
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = alone[name].chat_prompt(question)
    ref = alone[name].generate([prompt_ids], greedy)[0]
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert chat.choices[0].message.content == ref.outputs[0].text


def test_the_models_differ_where_they_should(server: Server) -> None:
    """Token ids are checked against the model's own vocabulary, and the context against its
    own length: what one model takes, the other refuses."""
    client = server.client()
    demo_vocab = server.app.state.models["demo"].engine.facts.vocab_size
    ids = [demo_vocab + 5]  # inside SmolLM2's vocabulary, outside the demo model's
    ok = client.completions.create(model="smollm2", prompt=ids, max_tokens=1)
    assert ok.usage.prompt_tokens == 1
    refused = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={"model": "demo", "prompt": ids, "max_tokens": 1},
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_token_id"
    long_prompt = list(range(10, 10 + 700))  # past demo's 512, within SmolLM2's 1024
    assert client.completions.create(model="smollm2", prompt=long_prompt, max_tokens=1)
    too_long = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={"model": "demo", "prompt": long_prompt, "max_tokens": 1},
    )
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    missing = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={"model": "llama", "prompt": "hi", "max_tokens": 1},
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_usage_rows_and_metrics_name_the_model(server: Server) -> None:
    client = server.client()
    for name in CONFIGS:
        client.completions.create(model=name, prompt="hello", max_tokens=2)
    database_url = server.tenancy.settings.database_url
    deadline = time.monotonic() + 30
    while {r["model"] for r in usage_rows(database_url)} != set(CONFIGS):
        assert time.monotonic() < deadline, usage_rows(database_url)
        time.sleep(0.1)
    assert all(r["adapter_name"] is None for r in usage_rows(database_url))
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in CONFIGS:
        assert f'loragate:num_requests_running{{model_name="{name}"}}' in text
        series = f'loragate:prefix_cache_queries_total{{model_name="{name}"}}'
        queried = re.search(re.escape(series) + r" (\S+)", text)
        assert queried is not None and float(queried.group(1)) > 0
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
