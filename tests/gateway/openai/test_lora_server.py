"""Adapters over HTTP: the `model` field picks an adapter; outputs equal the offline engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from live_server import Server, build_test_app, live_server, register_public

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.client import EngineClient
from engine.frontend.engine_process import EngineProcess, ProcessStart

MODEL = "demo"
ADAPTERS = ("r4-attn", "r8-all", "r16-all", "r8-attn", "r16-attn")


@pytest.fixture(scope="module")
def registry(demo_model_dir: Path, demo_adapters: dict[str, Path]) -> AdapterRegistry:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    for name in ADAPTERS:
        registry.register(name, demo_adapters[name])
    return registry


@pytest.fixture(scope="module", params=["thread", "process"])
def server(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    registry: AdapterRegistry,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    """Both engine loops: adapters cross into the engine process as paths and identities."""
    config = EngineConfig(
        model=str(demo_model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=512,
        max_loras=2,
        dtype="float32",
    )
    engine: EngineClient
    if request.param == "thread":
        engine = AsyncEngine(LLMEngine(config, lora_loader=registry.load), max_waiting=256)
    else:
        engine = EngineProcess(
            replace(config, num_threads=1), start=ProcessStart(registry.loader), max_waiting=256
        )
    engine.start()
    root = tmp_path_factory.mktemp("tenancy")
    app = build_test_app(engine, MODEL, root, demo_model_dir, allow_runtime_lora_updating=True)
    for name in ADAPTERS:
        register_public(app, name, demo_adapters[name])
    with live_server(app, engine) as server:
        yield server
    asyncio.run(engine.shutdown(0))


@pytest.fixture(scope="module")
def offline(demo_model_dir: Path, registry: AdapterRegistry) -> LLM:
    return LLM(
        str(demo_model_dir),
        kv_cache_memory=32 << 20,
        max_model_len=512,
        lora_loader=registry.load,
        dtype="float32",
    )


PROMPT = [5, 77, 301, 1200, 42, 9, 640, 18, 2200, 31]


def test_models_lists_the_adapters_with_the_base_as_parent(server: Server) -> None:
    models = {m.id: m for m in server.client().models.list().data}
    assert set(models) == {MODEL, *ADAPTERS}
    assert all(models[name].model_extra["parent"] == MODEL for name in ADAPTERS)


def test_concurrent_requests_on_five_adapters_and_the_base_match_the_offline_engine(
    server: Server, offline: LLM, registry: AdapterRegistry
) -> None:
    names = [*ADAPTERS, MODEL] * 2
    client = server.client()

    def complete(name: str) -> list[str]:
        resp = client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        assert resp.model == name
        return resp.choices[0].logprobs.tokens

    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(complete, names))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    loras = [registry.get(n) for n in names]
    expected = offline.generate([PROMPT] * len(names), params, lora_request=loras)
    tokenizer = offline.tokenizer
    for name, tokens, out in zip(names, got, expected, strict=True):
        assert tokens == [tokenizer.decode([t]) for t in out.outputs[0].token_ids], name
    assert got[0] != got[ADAPTERS.index("r16-all")]  # adapters really differ
    assert server.wait_all_blocks_free()


def test_streaming_chat_under_an_adapter(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model="r8-all",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.model == "r8-all" for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_an_unknown_adapter_is_a_404_in_openai_shape(server: Server) -> None:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={"model": "no-such-adapter", "prompt": "hi", "max_tokens": 2},
    )
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "no-such-adapter" in error["message"]


def test_adapters_load_replace_and_unload_at_runtime(
    server: Server, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    from adapters.demo import clone_adapter
    from adapters.peft import adapter_identity

    url = server.base_url
    client = server.client()

    def tokens() -> list[str]:
        resp = client.completions.create(
            model="runtime",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        return resp.choices[0].logprobs.tokens

    first, second = tmp_path / "first", tmp_path / "second"
    clone_adapter(demo_adapters["r8-all"], first, seed=21)
    clone_adapter(demo_adapters["r8-all"], second, seed=22)
    admin = server.admin_headers
    body = {"lora_name": "runtime", "lora_path": str(first)}
    # A tenant's key is not enough: these routes register public adapters.
    assert (
        httpx.post(f"{url}/v1/load_lora_adapter", headers=server.headers, json=body).status_code
        == 401
    )
    assert httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, json=body).status_code == 200
    before = tokens()
    first_id = adapter_identity(first)
    body["lora_path"] = str(second)
    assert httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, json=body).status_code == 200
    after = tokens()
    assert before != after  # the replaced adapter serves its new weights
    second_id = adapter_identity(second)

    # A missing directory, and a name too long for the filesystem (once a 500).
    for path in (str(tmp_path / "missing"), "0" * 4096):
        bad = {"lora_name": "broken", "lora_path": path}
        resp = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_path"
    assert "broken" not in {m.id for m in client.models.list().data}

    resp = httpx.post(f"{url}/v1/unload_lora_adapter", headers=admin, json={"lora_name": "runtime"})
    assert resp.status_code == 200
    resp = httpx.post(
        f"{url}/v1/completions", headers=server.headers, json={"model": "runtime", "prompt": "x"}
    )
    assert resp.status_code == 404
    resp = httpx.post(f"{url}/v1/unload_lora_adapter", headers=admin, json={"lora_name": "runtime"})
    assert resp.status_code == 404
    assert server.wait_all_blocks_free()
    if not isinstance(server.engine, AsyncEngine):
        return  # what follows reads the engine's memory, in this process only
    lora = server.engine.engine.lora
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and {first_id, second_id} & (
        set(lora.slot_of) | set(lora.cpu_cache)
    ):
        time.sleep(0.02)
    assert not {first_id, second_id} & (set(lora.slot_of) | set(lora.cpu_cache))


def test_metrics_report_adapter_slots_and_loads(server: Server) -> None:
    server.client().completions.create(model="r4-attn", prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'loragate:lora_requests_info{max_lora="2"' in text
    slots = [
        line
        for line in text.splitlines()
        if line.startswith(f'loragate:lora_slots_used{{model_name="{MODEL}"}} ')
    ]
    assert slots and 1.0 <= float(slots[0].split()[1]) <= 2.0
    loads = [
        line
        for line in text.splitlines()
        if line.startswith(f'loragate:lora_loads_total{{model_name="{MODEL}"}} ')
    ]
    assert loads and float(loads[0].split()[1]) >= 1.0
    # The pool holds at least that adapter, and its two slots' worth at most.
    usage = [
        line
        for line in text.splitlines()
        if line.startswith(f'loragate:lora_pool_usage_perc{{model_name="{MODEL}"}} ')
    ]
    assert usage and 0.0 < float(usage[0].split()[1]) <= 1.0
    assert f'loragate:lora_evictions_total{{model_name="{MODEL}"}} ' in text
