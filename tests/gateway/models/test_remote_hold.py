"""Engines elsewhere scaled to zero (gateway/models/replica_pool.py's HoldPolicy), as KEDA scales
a Kubernetes Deployment: with no `loragate engine` up, the gateway stays healthy, holds
requests (counted in `loragate:model_pending_requests`, the signal that wakes the engines),
refuses past the bound, and serves what it held once an engine comes up on the address
(the engine itself exports no such count). A request held past the timeout is a 503 too."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from live_server import Server, build_test_app, free_port, live_server

from engine import SamplingParams
from engine.errors import EngineOverloaded
from engine.frontend.facts import EngineFacts
from engine.messages import EngineRequest
from gateway.models.engine_knobs import engine_config
from gateway.models.replica_pool import HoldPolicy, PoolRouting, ReplicaPool
from gateway.remote.remote_engine import RemoteEngine
from gateway.settings import Settings

LORAGATE_CLI = str(Path(sys.executable).parent / "loragate")
TOKEN = "an-engine-token-that-is-long-enough-for-loragate-hold-0123456789"


def _pool(model_dir: Path, url: str, hold: HoldPolicy) -> ReplicaPool:
    settings = Settings(model=str(model_dir), max_model_len=512)
    facts = EngineFacts.read(str(model_dir), 512)
    replica = RemoteEngine(
        url,
        engine_config(settings),
        facts=facts,
        token=TOKEN,
    )
    replica.start(wait=0)  # nothing answers there yet: retried in the background
    return ReplicaPool("demo", [replica], [url], PoolRouting(16), hold=hold)


def _pending(server: Server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith('loragate:model_pending_requests{model="demo"}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no loragate:model_pending_requests for demo")


@pytest.fixture
def engine_port() -> Iterator[int]:
    port = free_port()
    yield port
    # the engine a test started there, if any: stopped by its process group
    for process in _started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)
    _started.clear()


_started: list[subprocess.Popen[bytes]] = []


def _start_engine(model_dir: Path, port: int, log: Path) -> None:
    command = [LORAGATE_CLI, "engine", "--model", str(model_dir), "--port", str(port)]
    command += ["--served-model-name", "demo", "--engine-token", TOKEN]
    command += ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--num-threads", "1"]
    with log.open("wb") as out:
        _started.append(
            subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )


def test_requests_are_held_until_an_engine_comes_up_then_served(
    demo_model_dir: Path, tmp_path: Path, engine_port: int
) -> None:
    url = f"http://127.0.0.1:{engine_port}"
    pool = _pool(demo_model_dir, url, HoldPolicy(max_pending=2, timeout=120, scale_to_zero=True))
    app = build_test_app(pool, "demo", tmp_path, demo_model_dir)  # type: ignore[arg-type]
    with live_server(app, pool) as server:  # type: ignore[arg-type]
        assert httpx.get(f"{server.base_url}/health").status_code == 200  # scaled to zero: ok
        body = {"model": "demo", "prompt": "held until an engine is up", "max_tokens": 4}

        def complete() -> httpx.Response:
            return httpx.post(
                f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=180
            )

        with ThreadPoolExecutor(2) as pool_threads:
            held = [pool_threads.submit(complete) for _ in range(2)]
            deadline = time.monotonic() + 30
            while _pending(server) < 2:
                assert time.monotonic() < deadline, "the requests were not held"
                time.sleep(0.05)
            over = complete()  # past the bound
            assert over.status_code == 503 and "Retry-After" in over.headers, over.text
            assert over.json()["error"]["code"] == "queue_full"
            assert not any(f.done() for f in held)

            _start_engine(demo_model_dir, engine_port, tmp_path / "engine.log")
            answers = [f.result() for f in held]
        log = (tmp_path / "engine.log").read_text()
        assert [a.status_code for a in answers] == [200, 200], ([a.text for a in answers], log)
        assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
        assert _pending(server) == 0
        # What wakes engines is the gateways' count alone: an engine exports its queue, not
        # the scaling series, which a sum over every pod scraped would count twice.
        engine_metrics = httpx.get(f"{url}/metrics").text
        assert "loragate:num_requests_waiting{" in engine_metrics
        assert "loragate:model_pending_requests" not in engine_metrics
    asyncio.run(pool.shutdown(0))


def test_a_request_held_past_the_timeout_is_refused(demo_model_dir: Path, engine_port: int) -> None:
    pool = _pool(
        demo_model_dir,
        f"http://127.0.0.1:{engine_port}",
        HoldPolicy(max_pending=4, timeout=0.3, scale_to_zero=False),
    )
    assert pool.health != "ok"  # down, and not expected to be: a failure

    async def generate() -> None:
        request = EngineRequest("held", [5, 6, 7], SamplingParams(max_tokens=1))
        async for _ in pool.generate(request):
            pass

    with pytest.raises(EngineOverloaded, match="came up within 0.3 s"):
        asyncio.run(generate())
    assert pool.scaling().num_held == 0
    asyncio.run(pool.shutdown(0))
