"""GET /admin/engines, and the adapters' `resident_on`: each served model's replicas, their
state, load and resident adapters, read from the engines themselves (gateway/models/states.py).
A live server serves `demo` (one engine with LoRA, started with it) and `lazy` (an engine on
demand, loops in threads of this process); the state rule's clock is checked on stand-ins."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from demo_starter import CONFIG, Starter
from joserfc import jwt
from joserfc.jwk import OctKey
from live_server import Server, admin_client, build_test_app, live_server, new_tenant

from adapters.peft import CONFIG_FILE, WEIGHTS_FILE, adapter_identity
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.facts import EngineFacts
from engine.messages import EngineStats
from gateway.http.request_limits import RequestLimits
from gateway.models.on_demand import OnDemandEngine, ScalePolicy
from gateway.models.replica_pool import PoolRouting, ReplicaPool
from gateway.models.served import ServedModels
from gateway.models.states import model_statuses, replica_state, routing_of

IDLE_TIMEOUT = 600.0  # the on-demand engine stays up (and not idle) for the whole test


@pytest.fixture
def starter(demo_model_dir: Path) -> Starter:
    return Starter(demo_model_dir)


@pytest.fixture
def server(
    tenancy_engine: AsyncEngine, starter: Starter, demo_model_dir: Path, tmp_path: Path
) -> Iterator[Server]:
    facts = EngineFacts.read(str(demo_model_dir), CONFIG["max_model_len"])
    policy = ScalePolicy(min_replicas=0, idle_timeout=IDLE_TIMEOUT, cold_start_timeout=60)
    lazy = OnDemandEngine("lazy", starter, facts, policy)
    app = build_test_app(
        tenancy_engine, "demo", tmp_path, demo_model_dir, more_models={"lazy": lazy}
    )
    with live_server(app, tenancy_engine) as live:
        yield live
    asyncio.run(lazy.shutdown(0))


def _engines(server: Server) -> dict[str, dict[str, Any]]:
    with admin_client(server) as admin:
        response = admin.get("/admin/engines")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    return {entry["model"]: entry for entry in body["data"]}


def _complete(server: Server, model: str, key: str | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key or server.tenancy.api_key}"},
        json={"model": model, "prompt": "The cat sat", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )


def _upload(admin: httpx.Client, directory: Path, name: str, tenant_id: str | None = None) -> str:
    files = {
        CONFIG_FILE: (CONFIG_FILE, (directory / CONFIG_FILE).read_bytes(), "application/json"),
        WEIGHTS_FILE: (WEIGHTS_FILE, (directory / WEIGHTS_FILE).read_bytes(), "application/x"),
    }
    data = {"name": name} | ({"tenant_id": tenant_id} if tenant_id else {})
    created = admin.post("/admin/adapters", data=data, files=files)
    assert created.status_code == 201, created.text
    assert created.json()["resident_on"] == []
    return str(created.json()["id"])


def test_engines_need_an_admin_token(server: Server) -> None:
    url = f"{server.base_url}/admin/engines"
    missing = httpx.get(url)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_admin_token"
    # A tenant's key is no admin token at all.
    tenant = httpx.get(url, headers=server.headers)
    assert tenant.status_code == 401
    assert tenant.json()["error"]["code"] == "invalid_admin_token"
    # A valid token without the admin scope.
    key = OctKey.import_key(server.tenancy.settings.admin_hs256_key())
    claims = {"sub": "viewer", "exp": int(time.time()) + 60, "scope": "read"}
    token = jwt.encode({"alg": "HS256"}, claims, key)
    scoped = httpx.get(url, headers={"Authorization": f"Bearer {token}"})
    assert scoped.status_code == 403
    assert scoped.json()["error"]["code"] == "insufficient_scope"


def test_a_used_adapter_is_resident_on_the_models_one_ready_replica(
    server: Server, demo_adapters: dict[str, Path]
) -> None:
    tenant_id, key = new_tenant(server, "acme")
    r8, r4 = demo_adapters["r8-all"], demo_adapters["r4-attn"]
    with admin_client(server) as admin:
        used = _upload(admin, r8, "support")
        twin = _upload(admin, r8, "acme-support", tenant_id)  # the same weights, stored once
        unused = _upload(admin, r4, "other")

        before = _engines(server)["demo"]
        assert before["routing"] == "local"
        assert before["pending_requests"] == 0 and before["cold_starts"] == 0
        (replica,) = before["replicas"]
        assert replica["id"] == "0" and replica["state"] == "ready"
        assert replica["cold_starts"] == 0
        assert replica["resident_adapters"] == []

        assert _complete(server, "support", key).status_code == 200
        after = _engines(server)["demo"]
        (replica,) = after["replicas"]
        assert replica["state"] == "ready"
        assert replica["num_running"] == replica["num_waiting"] == 0
        assert 0.0 <= replica["kv_cache_usage"] <= 1.0
        sha = adapter_identity(r8)
        # The engine holds weights: every adapter of this model with those weights is there.
        assert replica["resident_adapters"] == [
            {"id": used, "name": "support", "sha256": sha},
            {"id": twin, "name": "acme-support", "sha256": sha},
        ]

        here = [{"model": "demo", "replica": "0"}]
        listed = {row["id"]: row for row in admin.get("/admin/adapters").json()["data"]}
        assert listed[used]["resident_on"] == here and listed[twin]["resident_on"] == here
        assert listed[unused]["resident_on"] == []
        assert admin.get(f"/admin/adapters/{used}").json()["resident_on"] == here
        assert admin.get(f"/admin/adapters/{unused}").json()["resident_on"] == []


def test_an_engine_on_demand_is_stopped_then_starting_then_ready(
    server: Server, starter: Starter
) -> None:
    lazy = _engines(server)["lazy"]
    assert lazy["routing"] == "on_demand"
    assert lazy["pending_requests"] == 0 and lazy["cold_starts"] == 0
    assert lazy["replicas"] == [
        {
            "id": "0",
            "state": "stopped",
            "num_waiting": 0,
            "num_running": 0,
            "kv_cache_usage": 0.0,
            "resident_adapters": [],
            "cold_starts": 0,
        }
    ]

    starter.gate.clear()  # the engine "loads" until the gate opens
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_complete, server, "lazy")
        deadline = time.monotonic() + 30
        while _engines(server)["lazy"]["pending_requests"] == 0:
            assert time.monotonic() < deadline, "the request was never held"
            time.sleep(0.05)
        starting = _engines(server)["lazy"]
        assert starting["pending_requests"] == 1
        assert starting["replicas"][0]["state"] == "starting"
        starter.gate.set()
        assert held.result(60).status_code == 200

    ready = _engines(server)["lazy"]
    assert ready["pending_requests"] == 0 and ready["cold_starts"] == 1
    (replica,) = ready["replicas"]
    assert replica["state"] == "ready" and replica["cold_starts"] == 1


# -- the rule, on stand-ins: no model, no server ------------------------------------------------


class _Client:
    """An engine that is up (or dead), as OnDemandEngine holds one."""

    def __init__(self) -> None:
        self.health = "ok"

    @property
    def is_alive(self) -> bool:
        return self.health == "ok"

    def stats(self) -> EngineStats:
        return EngineStats(num_running=1, kv_cache_usage=0.5, resident_adapter_ids=["abc"])

    async def shutdown(self, grace_period: float = 10.0) -> None:
        self.health = "stopping"


def _on_demand(min_replicas: int, idle_timeout: float = 100.0) -> OnDemandEngine:
    facts = EngineFacts(tokenizer=None, vocab_size=8, max_model_len=16)
    policy = ScalePolicy(min_replicas=min_replicas, idle_timeout=idle_timeout)
    return OnDemandEngine("m", _Client, facts, policy)  # type: ignore[arg-type]


def test_idle_is_half_the_idle_timeout_unused_on_an_engine_that_scales_to_zero() -> None:
    engine = _on_demand(min_replicas=0)
    assert replica_state(engine, engine.last_used) == "stopped"  # not started yet
    engine.start_now()
    used = engine.last_used
    assert replica_state(engine, used) == "ready"
    assert replica_state(engine, used + 49.9) == "ready"
    assert replica_state(engine, used + 50.0) == "idle"
    engine.num_in_flight = 1  # a request under way (a long stream) is never idle
    assert replica_state(engine, used + 99.0) == "ready"
    engine.num_in_flight = 0
    client = engine.client
    assert client is not None
    client.health = "restarting"  # type: ignore[attr-defined]
    assert replica_state(engine, used) == "starting"
    client.health = "dead"  # type: ignore[attr-defined]
    assert replica_state(engine, used) == "stopped"
    # One that never idles out is ready however long unused.
    always = _on_demand(min_replicas=1)
    always.start_now()
    assert replica_state(always, always.last_used + 1e6) == "ready"


def test_a_pools_replicas_by_index_and_a_stopped_one_reports_nothing() -> None:
    first, second = _on_demand(min_replicas=1), _on_demand(min_replicas=0)
    first.start_now()
    pool = ReplicaPool("m", [first, second], ["m/0", "m/1"], PoolRouting(16))
    assert routing_of(pool) == "on_demand" and routing_of(first) == "local"
    (status,) = model_statuses(ServedModels({"m": pool}, RequestLimits()), now=first.last_used)
    assert status.routing == "on_demand" and status.num_cold_starts == 1
    assert [(r.id, r.state, r.num_cold_starts) for r in status.replicas] == [
        ("0", "ready", 1),
        ("1", "stopped", 0),
    ]
    assert status.replicas[0].stats.resident_adapter_ids == ["abc"]
    assert status.replicas[1].stats == EngineStats()
