"""Engines elsewhere: `loragate engine` processes as operators run them, two of them behind one
gateway (a models file's `urls`), reached over their WebSocket.

The engines refuse the internal routes without the engine token; greedy outputs through them
match the engine run in process; a tenant's requests stay on the replica that holds its prefix
and its adapter (the engines' own counters show it); and an engine SIGKILLed under load fails
its requests within 2 s with their usage rows while the other serves the rest.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from engine_services import TOKEN, EngineService, start_engine, wait_healthy
from live_server import (
    Server,
    build_test_app,
    live_server,
    new_tenant,
    register_public,
    wait_for_usage,
)
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from engine import LLM, SamplingParams
from engine.errors import GuidedSpecError
from engine.frontend.facts import EngineFacts
from engine.messages import EngineRequest
from engine.request import GuidedSpec
from gateway.models.engine_knobs import engine_config
from gateway.models.replica_pool import PoolRouting, ReplicaPool
from gateway.remote.remote_engine import RemoteEngine, engine_socket_url
from gateway.settings import Settings


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remote")


@pytest.fixture(scope="module")
def engines(demo_model_dir: Path, root: Path) -> Iterator[list[EngineService]]:
    """Two `loragate engine`s of the demo model sharing the gateway's adapter store."""
    started = [start_engine(demo_model_dir, root / "adapters", root / f"e{i}.log") for i in (0, 1)]
    try:
        for engine in started:
            wait_healthy(engine)
        yield started
    finally:
        for engine in started:
            if engine.process.poll() is None:
                os.killpg(engine.process.pid, signal.SIGTERM)
                engine.process.wait(30)


@pytest.fixture(scope="module")
def gateway(demo_model_dir: Path, root: Path, engines: list[EngineService]) -> Iterator[Server]:
    settings = Settings(model=str(demo_model_dir), max_model_len=512)
    facts = EngineFacts.read(str(demo_model_dir), 512)
    replicas = [
        RemoteEngine(
            engine.url,
            engine_config(settings),
            facts=facts,
            token=TOKEN,
        )
        for engine in engines
    ]
    for replica in replicas:
        replica.start()
    pool = ReplicaPool("demo", replicas, [e.url for e in engines], PoolRouting(16))
    app = build_test_app(pool, "demo", root, demo_model_dir)  # type: ignore[arg-type]
    with live_server(app, pool) as server:  # type: ignore[arg-type]
        yield server


def test_the_engine_refuses_its_internal_routes_without_the_token(
    engines: list[EngineService], demo_model_dir: Path
) -> None:
    url = engines[0].url
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        resp = httpx.get(f"{url}/internal/v1/state", headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_engine_token"
        with pytest.raises(InvalidStatus):  # no tenant context travels without the token
            connect(engine_socket_url(url), additional_headers=headers, proxy=None).close()
    answer = httpx.get(
        f"{url}/internal/v1/state", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()
    assert answer["hello"]["model"] == "demo"
    assert answer["state"]["num_running"] == 0
    assert httpx.get(f"{url}/health").status_code == 200


def test_greedy_through_remote_engines_matches_the_engine_in_process(
    gateway: Server, demo_model_dir: Path
) -> None:
    prompts = ["Hello there", "The quick brown fox", "Once upon a time in a land"]
    client = gateway.client()
    remote = [
        client.completions.create(model="demo", prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    local = LLM(str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=12)
    assert remote == [out.outputs[0].text for out in local.generate(prompts, params)]


def test_a_grammar_compiles_in_an_engine_and_a_bad_one_is_a_400_naming_its_field(
    gateway: Server,
) -> None:
    """The gateway compiles no grammar: it asks an engine over its link (one round trip)."""
    body = {"model": "demo", "prompt": "x", "max_tokens": 8, "temperature": 0}
    url, headers = f"{gateway.base_url}/v1/completions", gateway.headers
    bad = httpx.post(url, headers=headers, json=body | {"guided_regex": "a(b"}, timeout=60)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "guided_regex"
    assert "cannot compile the regex" in bad.json()["error"]["message"]
    good = httpx.post(url, headers=headers, json=body | {"guided_choice": ["left", "right"]})
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] in ("left", "right")


async def test_an_engine_refuses_a_grammar_nobody_asked_before_running_its_request(
    engines: list[EngineService], demo_model_dir: Path
) -> None:
    """A request sent without an ask (a gateway behind a picker asks none) has its grammar
    compiled by the engine first: refused as GuidedSpecError, not failed in a step."""
    settings = Settings(model=str(demo_model_dir), max_model_len=512)
    facts = EngineFacts.read(str(demo_model_dir), 512)
    replica = RemoteEngine(engines[0].url, engine_config(settings), facts=facts, token=TOKEN)
    replica.start()
    params = SamplingParams(max_tokens=4, guided=GuidedSpec(regex="a(b"))
    try:
        with pytest.raises(GuidedSpecError, match="cannot compile the regex"):
            async for _ in replica.generate(EngineRequest("unasked", "x", params)):
                pass
    finally:
        await replica.shutdown(0)


def _system_prompt(seed: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    return " ".join(words[(seed * 3 + i * 5) % len(words)] for i in range(60))


def test_a_tenants_prefix_stays_on_one_replica(gateway: Server) -> None:
    """Four tenants, each with its own long system prompt, four requests each: after its first
    request every one of a tenant's requests finds its prefix cached. Round-robin over two
    replicas would miss on about half."""
    pool: ReplicaPool = gateway.app.state.models["demo"].engine
    keys = [new_tenant(gateway, f"prefix-{i}")[1] for i in range(4)]
    for index, key in enumerate(keys):
        client = gateway.client(key)
        for turn in range(4):
            answer = client.chat.completions.create(
                model="demo",
                messages=[
                    {"role": "system", "content": _system_prompt(index)},
                    {"role": "user", "content": f"question {turn}"},
                ],
                max_tokens=2,
                temperature=0,
            )
            cached = answer.usage.prompt_tokens_details.cached_tokens
            if turn == 0:
                assert cached == 0  # its salt: no other tenant's cache
            else:
                assert cached >= 48, (index, turn, cached, pool.routed)
    assert all(count > 0 for count in pool.routed)  # both replicas took tenants


def test_requests_with_one_prompt_cache_key_go_to_one_replica(gateway: Server) -> None:
    """Different prompts, one prompt_cache_key: the key routes them, not their first blocks
    (six of which, on their own, all land on one of two replicas once in 32)."""
    pool: ReplicaPool = gateway.app.state.models["demo"].engine
    client = gateway.client(new_tenant(gateway, "cache-key")[1])

    before = list(pool.routed)
    for seed in range(6):
        client.completions.create(
            model="demo",
            prompt=_system_prompt(seed),
            max_tokens=1,
            extra_body={"prompt_cache_key": "shared-instructions"},
        )
    routed = [after - was for after, was in zip(pool.routed, before, strict=True)]
    assert sorted(routed) == [0, 6]


def test_an_adapter_is_loaded_on_one_replica_and_its_requests_follow_it(
    gateway: Server, engines: list[EngineService], demo_adapters: dict[str, Path]
) -> None:
    register_public(gateway.app, "sticky", demo_adapters["r8-all"])
    pool: ReplicaPool = gateway.app.state.models["demo"].engine
    loads_before = sum(e.metric("loragate:lora_loads_total") for e in engines)
    client = gateway.client()
    for turn in range(6):
        # Distinct first blocks: prefix affinity alone would spread these over both replicas.
        prompt = f"{turn} " + _system_prompt(turn + 10)
        client.completions.create(model="sticky", prompt=prompt, max_tokens=2, temperature=0)
        _wait_resident(pool)
    loads = sum(e.metric("loragate:lora_loads_total") for e in engines) - loads_before
    assert loads == 1  # read from disk once, on one replica, which then served them all

    # The admin REST shows the pool by url, the adapter in the slot of the replica that took it.
    admin = {"Authorization": f"Bearer {gateway.tenancy.admin_token}"}
    deadline = time.monotonic() + 5.0
    while True:
        (model,) = httpx.get(f"{gateway.base_url}/admin/engines", headers=admin).json()["data"]
        holders = [
            r["id"]
            for r in model["replicas"]
            if any(a["name"] == "sticky" for a in r["resident_adapters"])
        ]
        if holders or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert model["model"] == "demo" and model["routing"] == "remote"
    assert [(r["id"], r["state"]) for r in model["replicas"]] == [(e.url, "ready") for e in engines]
    assert len(holders) == 1
    (sticky,) = httpx.get(f"{gateway.base_url}/admin/adapters", headers=admin).json()["data"]
    assert sticky["resident_on"] == [{"model": "demo", "replica": holders[0]}]


def _wait_resident(pool: ReplicaPool, timeout: float = 5.0) -> None:
    """Until some replica reports an adapter in a slot (state reaches the gateway at most
    every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while not any(v.resident for v in pool.views()):
        assert time.monotonic() < deadline, "no replica reported the adapter resident"
        time.sleep(0.02)


def test_an_engine_killed_under_load_fails_only_its_requests_within_two_seconds(
    gateway: Server, engines: list[EngineService], root: Path
) -> None:
    """SIGKILL one engine while 8 long streams run on the two: those on it end with an error
    within 2 s (never a hang) and a usage row each; the others finish; new requests go to the
    survivor."""
    tenant_id, key = new_tenant(gateway, "kill")
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)
    streaming = threading.Semaphore(0)  # released once per stream that has its first tokens

    def stream(i: int) -> tuple[str, float]:
        try:
            chunks = client.completions.create(
                model="demo",
                prompt=f"{i} " + _system_prompt(i + 20),
                max_tokens=300,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for n, _ in enumerate(chunks):
                if n == 3:
                    streaming.release()
            return "finished", time.monotonic()
        except (openai.APIError, httpx.HTTPError):
            return "failed", time.monotonic()

    pool: ReplicaPool = gateway.app.state.models["demo"].engine
    victim = engines[1]
    with ThreadPoolExecutor(8) as threads:
        futures = [threads.submit(stream, i) for i in range(8)]
        for _ in range(8):  # every stream under way: none can move to the other replica now
            assert streaming.acquire(timeout=60)
        assert all(pool.in_flight), pool.in_flight  # both replicas serve some
        os.killpg(victim.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = [f.result(timeout=60) for f in futures]
    failed = [at for outcome, at in results if outcome == "failed"]
    assert failed, "no stream was running on the killed engine"
    assert max(failed) - killed_at < 2.0
    assert any(outcome == "finished" for outcome, _ in results)
    rows = wait_for_usage(gateway.tenancy.settings.database_url, 8, tenant_id=tenant_id)
    assert len(rows) == 8
    # Requests after the death go to the survivor at once.
    after = client.completions.create(model="demo", prompt="still there?", max_tokens=3)
    assert after.choices[0].text


def test_the_engines_openai_routes_take_tenant_context_only_with_the_token(
    gateway: Server, engines: list[EngineService], root: Path, demo_adapters: dict[str, Path]
) -> None:
    """An inference router sends OpenAI requests straight to an engine: anonymous ones are
    served; tenant headers without the token are a 401; with it, a salt keeps its own cache and
    an adapter from the store serves."""
    url = f"{engines[0].url}/v1/completions"
    body = {"model": "demo", "prompt": _system_prompt(40), "max_tokens": 4, "temperature": 0}
    anonymous = httpx.post(url, json=body, timeout=60)
    assert anonymous.status_code == 200, anonymous.text
    refused = httpx.post(url, json=body, headers={"X-Loragate-Cache-Salt": "victim"})
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_engine_token"

    token = {"Authorization": f"Bearer {TOKEN}"}

    def cached(salt: str) -> int:
        answer = httpx.post(url, json=body, headers=token | {"X-Loragate-Cache-Salt": salt})
        assert answer.status_code == 200, answer.text
        return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("tenant-a") == 0  # not the anonymous requests' cache
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0

    register_public(gateway.app, "direct", demo_adapters["r16-all"])
    (store_dir,) = [
        p for p in (root / "adapters").iterdir() if len(p.name) == 64 and _holds(p, "r16")
    ]
    adapted = httpx.post(
        url,
        json=body | {"model": "direct"},
        headers=token | {"X-Loragate-Adapter": store_dir.name},
        timeout=60,
    )
    assert adapted.status_code == 200, adapted.text
    assert adapted.json()["choices"][0]["text"] != anonymous.json()["choices"][0]["text"]
    missing = httpx.post(
        url, json=body, headers=token | {"X-Loragate-Adapter": "0" * 64}, timeout=60
    )
    assert missing.status_code == 404


def _holds(adapter_dir: Path, rank_tag: str) -> bool:
    config = (adapter_dir / "adapter_config.json").read_text()
    return '"r": 16' in config if rank_tag == "r16" else '"r": 8' in config
