"""Tenants apart: prefix-cache salts derived by the server (shared only inside a cache group),
registrations that survive a restart, admin inputs that cannot reach the database or the
disk; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import httpx
import pytest
from live_server import Server, ServerTenancy, admin_client, live_server, new_tenant

from adapters.peft import describe_base
from engine.frontend.async_engine import AsyncEngine
from gateway.app import build_app
from gateway.tenancy.state import open_tenancy, prepare

MODEL = "demo"
PROMPT = list(range(1000, 1512))  # 512 tokens: 31 full blocks can hit (the last is computed)


def _cached(server: Server, key: str, **extra: object) -> int:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1} | extra,
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenants_never_hit_each_others_cache_but_a_cache_group_shares(
    tenancy_server: Server,
) -> None:
    server = tenancy_server
    _, a = new_tenant(server, "salt-a")
    _, b = new_tenant(server, "salt-b")
    group = f"partners-{secrets.token_hex(4)}"  # the engine outlives this test's database
    _, c = new_tenant(server, "salt-c", cache_group=group)
    _, d = new_tenant(server, "salt-d", cache_group=group)
    full = (len(PROMPT) - 1) // 16 * 16
    assert _cached(server, a) == 0
    assert _cached(server, a) == full  # a hits its own blocks
    # A client's cache_salt is ignored: b cannot ask for a's salt, whatever it sends.
    assert _cached(server, b, cache_salt="anything") == 0
    assert _cached(server, b) == full
    assert _cached(server, c) == 0
    assert _cached(server, d) == full  # one cache group shares
    assert server.wait_all_blocks_free()


def test_keys_and_adapters_survive_a_restart(
    tenancy_engine: AsyncEngine,
    tenancy_server: Server,
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
) -> None:
    from test_admin_adapters import upload

    first = tenancy_server
    tenant_id, key = new_tenant(first, "survivor")
    with admin_client(first) as admin:
        assert upload(admin, demo_adapters["r8-all"], "kept", tenant_id).status_code == 201
    body = {"model": "kept", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    auth = {"Authorization": f"Bearer {key}"}
    before = httpx.post(f"{first.base_url}/v1/completions", json=body, headers=auth).json()

    # A new server process in all but name: new tenancy objects on the same database and store.
    settings = first.tenancy.settings
    tenancy = open_tenancy(settings, {MODEL: describe_base(demo_model_dir, extra_names=[MODEL])})

    async def start() -> None:
        await prepare(tenancy, settings)
        await tenancy.db.close()

    asyncio.run(start())
    app = build_app({MODEL: tenancy_engine}, tenancy)
    app.state.server_tenancy = ServerTenancy(
        tenancy, settings, tenant_id, key, first.tenancy.admin_token
    )
    with live_server(app, tenancy_engine) as second:
        after = httpx.post(f"{second.base_url}/v1/completions", json=body, headers=auth)
        assert after.status_code == 200
        assert after.json()["choices"][0]["text"] == before["choices"][0]["text"]
        models = httpx.get(f"{second.base_url}/v1/models", headers=auth).json()["data"]
        assert {m["id"] for m in models} == {MODEL, "kept"}


@pytest.mark.parametrize(
    "name",
    ["a/b", "..", "../../etc/passwd", "ünïcödé", "x" * 10_000, "a'; DROP TABLE tenants; --", ""],
)
def test_hostile_tenant_names_are_400s_that_touch_nothing(
    tenancy_server: Server, name: str
) -> None:
    with admin_client(tenancy_server) as admin:
        resp = admin.post("/admin/tenants", json={"name": name})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "name"
        listed = admin.get("/admin/tenants").json()["data"]
        assert [t["name"] for t in listed] == ["tester"]


def test_admin_routes_refuse_unknown_ids_fields_and_content_types(tenancy_server: Server) -> None:
    with admin_client(tenancy_server) as admin:
        for method, path in [
            ("GET", "/admin/tenants/ten_nope"),
            ("PATCH", "/admin/tenants/ten_nope"),
            ("DELETE", "/admin/tenants/ten_nope"),
            ("GET", "/admin/tenants/ten_nope/keys"),
            ("DELETE", "/admin/keys/key_nope"),
            ("GET", "/admin/adapters/ad_nope"),
            ("DELETE", "/admin/adapters/ad_nope"),
        ]:
            resp = admin.request(method, path, json={} if method == "PATCH" else None)
            assert resp.status_code == 404, (method, path)
            assert resp.json()["error"]["type"] == "not_found_error"
        assert admin.post("/admin/tenants", json={"name": "x", "admin": True}).status_code == 400
        plain = admin.post(
            "/admin/tenants", content=b"name=x", headers={"content-type": "text/plain"}
        )
        assert plain.status_code == 400
        assert admin.post("/admin/tenants", json={"name": "tester"}).status_code == 409
        assert admin.post("/admin/tenants", json={"name": "w", "weight": -1}).status_code == 400
        wrong = admin.put("/admin/tenants")
        assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]
