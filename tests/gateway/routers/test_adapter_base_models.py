"""Adapters bound to a base model, through the admin REST and the openai client, with two base
models known to the server: `base_model` required and checked, an adapter refused (naming the
module) where its shapes do not fit, one name on two models for one owner, `name@base`, and a
bare name that is ambiguous; on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from live_server import Server, admin_client, new_tenant, wait_for_usage
from second_base import WIDE, retarget, two_base_server, wide_adapter, wide_base, wide_model_dir

from adapters.peft import CONFIG_FILE, WEIGHTS_FILE

__all__ = ["two_base_server", "wide_adapter", "wide_base", "wide_model_dir"]  # fixtures

DEMO = "demo"
PROMPT = [5, 77, 301, 1200, 42, 9, 640]


def upload(
    admin: httpx.Client,
    directory: Path,
    name: str,
    tenant_id: str | None = None,
    base_model: str | None = None,
) -> httpx.Response:
    fields = {"name": name, "tenant_id": tenant_id, "base_model": base_model}
    files = {
        part: (part, (directory / part).read_bytes(), "application/octet-stream")
        for part in (CONFIG_FILE, WEIGHTS_FILE)
    }
    data = {k: v for k, v in fields.items() if v is not None}
    return admin.post("/admin/adapters", data=data, files=files)


def _error(resp: httpx.Response, status: int, code: str, param: str) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    return str(error["message"])


def test_an_upload_names_a_served_base_model_and_must_fit_it(
    two_base_server: Server, demo_adapters: dict[str, Path], wide_adapter: Path, tmp_path: Path
) -> None:
    tenant_id, _ = new_tenant(two_base_server, "owner")
    r8 = demo_adapters["r8-all"]
    with admin_client(two_base_server) as admin:
        message = _error(upload(admin, r8, "sql", tenant_id), 400, "invalid_value", "base_model")
        assert "required" in message and "'demo', 'wide'" in message
        unknown = upload(admin, r8, "sql", tenant_id, base_model="nope")
        assert "'nope'" in _error(unknown, 400, "invalid_value", "base_model")
        # Files that claim no base model, whose shapes do not fit `wide`: the module named.
        unclaimed = retarget(r8, tmp_path / "unclaimed", None)
        misfit = upload(admin, unclaimed, "sql", tenant_id, base_model=WIDE)
        message = _error(misfit, 400, "invalid_adapter", "adapter")
        assert "'wide'" in message and "q_proj" in message and "has shape" in message
        # The JSON variant (a server-local directory) takes base_model the same way.
        local = {"name": "local", "path": str(demo_adapters["r4-attn"])}
        _error(admin.post("/admin/adapters", json=local), 400, "invalid_value", "base_model")
        created = admin.post("/admin/adapters", json=local | {"base_model": DEMO})
        assert created.status_code == 201 and created.json()["base_model"] == DEMO
        assert admin.get("/admin/adapters", params={"tenant_id": tenant_id}).json()["data"] == []

        # One owner, one name, two models; a second `sql` on one of them is taken.
        on_demo = upload(admin, r8, "sql", tenant_id, base_model=DEMO)
        on_wide = upload(admin, wide_adapter, "sql", tenant_id, base_model=WIDE)
        assert on_demo.status_code == on_wide.status_code == 201, (on_demo.text, on_wide.text)
        assert (on_demo.json()["base_model"], on_wide.json()["base_model"]) == (DEMO, WIDE)
        again = upload(admin, demo_adapters["r4-attn"], "sql", tenant_id, base_model=DEMO)
        assert "'demo'" in _error(again, 409, "adapter_exists", "name")
        listed = admin.get("/admin/adapters", params={"tenant_id": tenant_id}).json()["data"]
        assert sorted((a["name"], a["base_model"]) for a in listed) == [
            ("sql", DEMO),
            ("sql", WIDE),
        ]


def test_name_at_base_picks_the_model_and_a_bare_ambiguous_name_is_refused(
    two_base_server: Server, demo_adapters: dict[str, Path], wide_adapter: Path
) -> None:
    server = two_base_server
    tenant_id, key = new_tenant(server, "owner")
    r8 = demo_adapters["r8-all"]
    with admin_client(server) as admin:
        for directory, name, base in (
            (r8, "sql", DEMO),
            (wide_adapter, "sql", WIDE),
            (r8, "alone", DEMO),
        ):
            created = upload(admin, directory, name, tenant_id, base_model=base)
            assert created.status_code == 201, created.text
    client = server.client(key)

    def text(model: str) -> str:
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        return out.choices[0].text

    with pytest.raises(openai.BadRequestError) as ambiguous:
        text("sql")
    error = ambiguous.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("ambiguous_model", "model")
    assert "`sql@demo`, `sql@wide`" in error["message"]
    assert text("sql@demo") == text("alone") != text(DEMO)
    with pytest.raises(openai.NotFoundError):  # no engine serves `wide` on this server
        text("sql@wide")
    models = {m.id: m.model_dump().get("parent") for m in client.models.list()}
    assert models == {DEMO: None, "alone": DEMO, "sql@demo": DEMO}
    # Billed under the adapter's own name, on the base model that served it.
    rows = wait_for_usage(
        server.tenancy.settings.database_url, 1, tenant_id=tenant_id, adapter_name="sql"
    )
    assert {row["model"] for row in rows} == {DEMO}


def test_runtime_loading_takes_a_base_model_and_unloading_the_listed_id(
    two_base_server: Server, demo_adapters: dict[str, Path], wide_adapter: Path, tmp_path: Path
) -> None:
    server = two_base_server
    r8 = demo_adapters["r8-all"]

    def post(route: str, **body: str) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/{route}", headers=server.admin_headers, json=body)

    def listed() -> dict[str, object]:
        return {m.id: m.model_dump().get("parent") for m in server.client().models.list()}

    missing = post("load_lora_adapter", lora_name="rt", lora_path=str(r8))
    assert "required" in _error(missing, 400, "invalid_value", "base_model")
    taken = post("load_lora_adapter", lora_name=WIDE, lora_path=str(r8), base_model=DEMO)
    _error(taken, 400, "invalid_value", "lora_name")  # a served model's name
    unclaimed = retarget(r8, tmp_path / "unclaimed", None)
    misfit = post("load_lora_adapter", lora_name="rt", lora_path=str(unclaimed), base_model=WIDE)
    assert "q_proj" in _error(misfit, 400, "invalid_adapter", "lora_path")
    for path, base in ((r8, DEMO), (wide_adapter, WIDE)):
        loaded = post("load_lora_adapter", lora_name="rt", lora_path=str(path), base_model=base)
        assert loaded.status_code == 200, loaded.text
    assert listed() == {DEMO: None, "rt@demo": DEMO}  # `wide` has no engine here

    ambiguous = post("unload_lora_adapter", lora_name="rt")
    assert "`rt@demo`, `rt@wide`" in _error(ambiguous, 400, "ambiguous_model", "lora_name")
    assert post("unload_lora_adapter", lora_name="rt@wide").status_code == 200
    assert post("unload_lora_adapter", lora_name="rt@wide").status_code == 404
    assert listed() == {DEMO: None, "rt": DEMO}  # unique again: the bare name
    assert server.client().completions.create(model="rt", prompt=PROMPT, max_tokens=1).choices
    assert post("unload_lora_adapter", lora_name="rt").status_code == 200
    assert listed() == {DEMO: None}
