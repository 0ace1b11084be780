"""A tenant's `allowed_models` through the admin REST (set, read back, cleared, refused when it
names a model the server does not serve or too many), and over HTTP with the openai client: a
model outside the list, or an adapter of one, is the very 404 of a model that does not exist;
on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from live_server import Server, admin_client, new_tenant
from second_base import WIDE, two_base_server, wide_base, wide_model_dir
from test_adapter_base_models import upload

__all__ = ["two_base_server", "wide_base", "wide_model_dir"]  # fixtures

DEMO = "demo"


def _refused(resp: httpx.Response, param: str) -> dict[str, object]:
    assert resp.status_code == 400, resp.text
    error: dict[str, object] = resp.json()["error"]
    assert error["param"] == param
    return error


def test_allowed_models_are_set_read_back_and_cleared(two_base_server: Server) -> None:
    with admin_client(two_base_server) as admin:
        created = admin.post("/admin/tenants", json={"name": "narrow", "allowed_models": [WIDE]})
        assert created.status_code == 201, created.text
        tenant_id = created.json()["id"]
        assert created.json()["allowed_models"] == [WIDE]
        assert admin.get(f"/admin/tenants/{tenant_id}").json()["allowed_models"] == [WIDE]
        open_one = admin.post("/admin/tenants", json={"name": "open"}).json()
        assert open_one["allowed_models"] is None  # every model
        listed = {
            t["name"]: t["allowed_models"] for t in admin.get("/admin/tenants").json()["data"]
        }
        assert listed == {"tester": None, "narrow": [WIDE], "open": None}

        def patch(**fields: object) -> httpx.Response:
            return admin.patch(f"/admin/tenants/{tenant_id}", json=fields)

        # Each name once, in the order given; other changes leave the list alone.
        assert patch(allowed_models=[DEMO, WIDE, DEMO]).json()["allowed_models"] == [DEMO, WIDE]
        assert patch(weight=2.0).json()["allowed_models"] == [DEMO, WIDE]
        assert patch(allowed_models=[]).json()["allowed_models"] == []  # no model at all
        assert patch(allowed_models=None).json()["allowed_models"] is None
        assert admin.get(f"/admin/tenants/{tenant_id}").json()["allowed_models"] is None

        # A name the server does not serve, named in the answer; nothing changes.
        error = _refused(patch(allowed_models=[DEMO, "gpt-4o"]), "allowed_models")
        assert error["code"] == "invalid_value" and "'gpt-4o'" in str(error["message"])
        assert admin.get(f"/admin/tenants/{tenant_id}").json()["allowed_models"] is None
        error = _refused(
            admin.post("/admin/tenants", json={"name": "typo", "allowed_models": ["dmeo"]}),
            "allowed_models",
        )
        assert error["code"] == "invalid_value" and "'dmeo'" in str(error["message"])
        # At most 64 names, each a non-empty string.
        _refused(patch(allowed_models=[DEMO] * 65), "allowed_models")
        assert patch(allowed_models=[DEMO] * 64).json()["allowed_models"] == [DEMO]
        for bad in (DEMO, [""], [7], ["x" * 257]):
            assert patch(allowed_models=bad).status_code == 400, bad
        names = {t["name"] for t in admin.get("/admin/tenants").json()["data"]}
        assert names == {"tester", "narrow", "open"}  # nothing made by a refusal


def test_a_model_outside_the_list_is_the_404_of_a_model_that_does_not_exist(
    two_base_server: Server, demo_adapters: dict[str, Path]
) -> None:
    server = two_base_server
    tenant_id, key = new_tenant(server, "narrow", allowed_models=[WIDE])
    with admin_client(server) as admin:
        mine = upload(admin, demo_adapters["r8-all"], "mine", tenant_id, base_model=DEMO)
        assert mine.status_code == 201, mine.text
        assert upload(admin, demo_adapters["r4-attn"], "public", base_model=DEMO).status_code == 201
    client = server.client(key)

    def not_found(model: str, chat: bool = False) -> str:
        with pytest.raises(openai.NotFoundError) as refused:
            if chat:
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
            else:
                client.completions.create(model=model, prompt="hi", max_tokens=1)
        assert refused.value.status_code == 404
        return refused.value.response.text.replace(model, "MODEL")

    nowhere = not_found("no-such-model")
    assert '"code":"model_not_found"' in nowhere.replace(" ", "")
    for model in (DEMO, "mine", "mine@demo", "public"):
        assert not_found(model) == nowhere, model
    assert not_found(DEMO, chat=True) == not_found("no-such-model", chat=True)
    assert [m.id for m in client.models.list()] == []  # `wide` has no engine here

    # Allowed again: the same key works at once (this replica's caches are dropped).
    with admin_client(server) as admin:
        patched = admin.patch(f"/admin/tenants/{tenant_id}", json={"allowed_models": [DEMO]})
        assert patched.status_code == 200, patched.text
    for model in (DEMO, "mine", "mine@demo", "public"):
        assert client.completions.create(model=model, prompt="hi", max_tokens=1).choices
    assert {m.id for m in client.models.list()} == {DEMO, "mine", "public"}
    with admin_client(server) as admin:
        admin.patch(f"/admin/tenants/{tenant_id}", json={"allowed_models": None})
    assert {m.id for m in client.models.list()} == {DEMO, "mine", "public"}
