"""Engines on demand (gateway/models/on_demand.py) behind a live server: a model with
min_replicas 0 has no engine until its first request, holds the requests that arrive while it
starts, answers them all, stops after idle_timeout, and starts again when called; the pending
bound and the cold-start timeout are 503s with Retry-After. The engines here are loops in
threads of this process; tests/gateway/cli/test_serve_models_cli.py checks engine processes."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from demo_starter import CONFIG, Starter
from live_server import Server, build_test_app, live_server

from engine import EngineConfig, LLMEngine
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.facts import EngineFacts
from gateway.models.on_demand import OnDemandEngine, ScalePolicy

IDLE_TIMEOUT = 1.0


@pytest.fixture
def starter(demo_model_dir: Path) -> Starter:
    return Starter(demo_model_dir)


@pytest.fixture
def lazy(starter: Starter, demo_model_dir: Path) -> OnDemandEngine:
    facts = EngineFacts.read(str(demo_model_dir), CONFIG["max_model_len"])
    policy = ScalePolicy(
        min_replicas=0, idle_timeout=IDLE_TIMEOUT, max_pending=3, cold_start_timeout=30
    )
    return OnDemandEngine("lazy", starter, facts, policy)


@pytest.fixture
def server(
    lazy: OnDemandEngine, starter: Starter, demo_model_dir: Path, tmp_path: Path
) -> Iterator[Server]:
    always = AsyncEngine(LLMEngine(EngineConfig(model=str(demo_model_dir), **CONFIG)))
    always.start()
    app = build_test_app(always, "demo", tmp_path, demo_model_dir, more_models={"lazy": lazy})
    with live_server(app, always) as live:
        yield live
    for engine in [always, *starter.engines]:
        asyncio.run(engine.shutdown(0))


def _complete(server: Server, model: str, prompt: str = "The cat sat") -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )


def _metric(server: Server, series: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    found = re.search(re.escape(series) + r" (\S+)", text)
    assert found is not None, series
    return float(found.group(1))


def _wait_until(condition: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_no_engine_until_called_then_idle_out_and_back(
    server: Server, lazy: OnDemandEngine, starter: Starter
) -> None:
    assert lazy.scaling().num_ready == 0 and starter.engines == []
    assert _metric(server, 'loragate:engine_replicas{model="lazy"}') == 0
    assert _metric(server, 'loragate:engine_replicas{model="demo"}') == 1
    # The edge knows the model before its engine runs.
    listed = {
        m["id"]: m
        for m in httpx.get(f"{server.base_url}/v1/models", headers=server.headers).json()["data"]
    }
    assert listed["lazy"]["max_model_len"] == CONFIG["max_model_len"]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}

    first = _complete(server, "lazy")
    assert first.status_code == 200, first.text
    # The same weights as the always-on model: the same greedy answer.
    assert (
        first.json()["choices"][0]["text"] == _complete(server, "demo").json()["choices"][0]["text"]
    )
    assert lazy.scaling().num_ready == 1 and len(starter.engines) == 1
    assert _metric(server, 'loragate:engine_cold_starts_total{model="lazy"}') == 1
    assert _metric(server, 'loragate:engine_cold_start_seconds_count{model="lazy"}') == 1

    _wait_until(lambda: lazy.scaling().num_ready == 0)
    assert not starter.engines[0].is_alive  # its loop ended: the memory can go back
    assert _metric(server, 'loragate:engine_replicas{model="lazy"}') == 0

    again = _complete(server, "lazy")
    assert again.status_code == 200 and again.json()["choices"] == first.json()["choices"]
    assert len(starter.engines) == 2
    assert _metric(server, 'loragate:engine_cold_starts_total{model="lazy"}') == 2


def test_requests_held_during_a_cold_start_are_all_answered_and_the_bound_is_a_503(
    server: Server, lazy: OnDemandEngine, starter: Starter
) -> None:
    starter.gate.clear()  # the engine "loads" until the gate opens
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(_complete, server, "lazy", f"prompt {i}") for i in range(3)]
        _wait_until(lambda: lazy.num_held == 3)
        assert _metric(server, 'loragate:model_pending_requests{model="lazy"}') == 3
        over = _complete(server, "lazy")
        assert over.status_code == 503 and over.headers["Retry-After"]
        assert over.json()["error"]["code"] == "queue_full"
        assert "is starting" in over.json()["error"]["message"]
        starter.gate.set()
        answers = [f.result(timeout=60) for f in held]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert len(starter.engines) == 1  # one start served every held request


def test_a_start_past_the_timeout_or_failing_is_a_503_and_the_next_request_retries(
    server: Server, lazy: OnDemandEngine, starter: Starter
) -> None:
    lazy.policy = ScalePolicy(0, IDLE_TIMEOUT, 3, cold_start_timeout=0.5)
    starter.gate.clear()
    late = _complete(server, "lazy")
    assert late.status_code == 503 and late.headers["Retry-After"]
    assert "did not start within 0.5 s" in late.json()["error"]["message"]
    starter.fail = True
    starter.gate.set()
    _wait_until(lambda: lazy._starting is None)  # the start in flight fails
    failed = _complete(server, "lazy")
    assert failed.status_code == 503 and "failed to start" in failed.json()["error"]["message"]
    starter.fail = False
    assert _complete(server, "lazy").status_code == 200
    assert lazy.scaling().num_ready == 1
