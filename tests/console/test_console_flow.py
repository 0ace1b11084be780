"""The console as an admin and billing use it, in a real Chromium against a live `loragate
serve`: sign in, create a tenant, set its limits, create a key and read it once, upload an
adapter (and a broken one), call the API with the new key, see the usage on the chart's table
and in the CSV, revoke the key, suspend the tenant. Each step asserts on what the page shows,
and the API is asked whether it happened."""

from __future__ import annotations

import csv
import io
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from console_server import MODEL, ConsoleServer, screenshot, sign_in
from playwright.sync_api import expect

TENANT = "acme-console"
ADAPTER = "sql-console"


def _completion(server: ConsoleServer, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "Hello there", "max_tokens": 5, "temperature": 0}
    return httpx.post(
        f"{server.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_console_end_to_end(
    page: Any, console_server: ConsoleServer, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    server = console_server

    # A tenant key is refused at sign-in, with the admin REST's message, at the field.
    page.goto(f"{server.url}/console")
    page.get_by_label("Admin token").fill(server.demo_key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("invalid admin token")
    screenshot(page, "sign-in")

    sign_in(page, server)

    # Create a tenant: the page moves to it.
    page.get_by_label("Name", exact=True).fill(TENANT)
    page.get_by_role("button", name="Create tenant").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text(TENANT)
    expect(page.locator("#tenant-status")).to_have_text("active")
    tenant_id = page.locator("main p.mono").first.inner_text().strip()

    # Limits: saved, shown again after a reload, and what the API reads.
    page.get_by_label("Requests per minute").fill("600")
    page.get_by_label("Monthly token quota").fill("1000000")
    page.get_by_label("Fairness weight").fill("2")
    page.get_by_role("button", name="Save limits").click()
    expect(page.get_by_role("status")).to_contain_text("Limits saved")
    page.reload()
    expect(page.get_by_label("Requests per minute")).to_have_value("600")
    expect(page.get_by_label("Monthly token quota")).to_have_value("1000000")
    stored = httpx.get(f"{server.url}/admin/tenants/{tenant_id}", headers=server.admin()).json()
    assert (stored["rpm_limit"], stored["monthly_token_quota"], stored["weight"]) == (
        600,
        1000000,
        2.0,
    )

    # A key, shown once; a second one for the suspension below.
    keys = []
    for name in ("billing", "spare"):
        page.get_by_label("Key name").fill(name)
        page.get_by_role("button", name="Create key").click()
        shown = page.locator("#new-key-value")
        expect(page.get_by_role("table", name="API keys").locator("tbody tr")).to_have_count(
            len(keys) + 1
        )
        expect(shown).to_be_visible()
        if keys:
            expect(shown).not_to_have_value(keys[-1])
        keys.append(shown.input_value())
        assert keys[-1].startswith("lg-")
        expect(page.get_by_text("This key is shown once.")).to_be_visible()
    screenshot(page, "tenant")
    page.reload()
    expect(page.locator("#new-key-value")).to_have_count(0)  # never shown again
    rows = page.get_by_role("table", name="API keys").locator("tbody tr")
    expect(rows).to_have_count(2)
    for key in keys:
        expect(page.get_by_text(f"{key[:11]}", exact=False).first).to_be_visible()
    key, spare = keys

    # An adapter through the file pickers, and a broken one whose error shows at the files.
    page.get_by_role("link", name="Adapters").click()
    expect(page.get_by_role("heading", name="Adapters", exact=True)).to_be_visible()
    source = demo_adapters["r4-attn"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": "x"}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    form = page.locator("form", has=page.get_by_role("heading", name="Upload an adapter"))
    form.get_by_label("Name", exact=True).fill("broken-one")
    form.get_by_label("adapter_config.json").set_input_files(broken / "adapter_config.json")
    form.get_by_label("adapter_model.safetensors").set_input_files(
        broken / "adapter_model.safetensors"
    )
    form.get_by_role("button", name="Upload").click()
    error = form.locator("fieldset .field-error, fieldset + .field-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("adapter_config.json")
    screenshot(page, "adapter-error")
    listed = httpx.get(f"{server.url}/admin/adapters", headers=server.admin()).json()["data"]
    assert not [a for a in listed if a["name"] == "broken-one"]  # nothing half-registered

    form.get_by_label("Name", exact=True).fill(ADAPTER)
    form.get_by_label("Owner (tenant id)").fill(tenant_id)
    form.get_by_label("adapter_config.json").set_input_files(source / "adapter_config.json")
    form.get_by_label("adapter_model.safetensors").set_input_files(
        source / "adapter_model.safetensors"
    )
    form.get_by_role("button", name="Upload").click()
    expect(page.get_by_role("status")).to_contain_text(f"Adapter {ADAPTER} uploaded")
    adapters = page.get_by_role("table", name="Adapters")
    expect(adapters.locator("tr", has_text=ADAPTER)).to_contain_text(tenant_id)

    # The API with the new key: the base model and the tenant's adapter.
    for model in (MODEL, ADAPTER, MODEL):
        response = _completion(server, key, model)
        assert response.status_code == 200, response.text
    screenshot(page, "adapters")

    # Usage: the page's table holds the ledger's numbers, as does its CSV.
    _wait_for_usage(server, tenant_id, requests=3)
    page.get_by_role("link", name="Usage").click()
    page.get_by_label("Stack by").select_option("tenant")
    page.get_by_role("button", name="Show").click()
    table = page.get_by_role("table", name="Usage by day")
    expect(table.locator("tr", has_text=tenant_id)).to_have_count(1)
    day = datetime.now(UTC).date().isoformat()
    answer = httpx.get(
        f"{server.url}/admin/usage",
        params=[
            ("from", day),
            ("to", _next_day(day)),
            ("group_by", "day"),
            ("group_by", "tenant"),
            ("top", "10"),
        ],
        headers=server.admin(),
    ).json()["data"]
    ours = next(r for r in answer if r.get("tenant") == tenant_id)
    cells = table.locator("tr", has_text=tenant_id).locator("td").all_inner_texts()
    assert cells[0] == day
    assert [int(c.replace(",", "")) for c in cells[2:]] == [
        ours["num_requests"],
        ours["prompt_tokens"],
        ours["completion_tokens"],
        ours["prompt_tokens"] + ours["completion_tokens"],
    ]
    assert ours["num_requests"] == 3
    expect(page.locator(".chart canvas")).to_have_count(1)
    screenshot(page, "usage")

    with page.expect_download() as download:
        page.get_by_role("button", name="Export CSV").click()
    shown = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    by_tenant = {row["tenant"]: row for row in shown}
    assert int(by_tenant[tenant_id]["prompt_tokens"]) == ours["prompt_tokens"]
    assert int(by_tenant[tenant_id]["completion_tokens"]) == ours["completion_tokens"]
    assert len(shown) == len(answer)

    # Revoke the key: the page says so, the API refuses it.
    page.goto(f"{server.url}/console#/tenants/{tenant_id}")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("table", name="API keys").locator("tr", has_text="billing").get_by_role(
        "button", name="Revoke"
    ).click()
    expect(page.get_by_role("status")).to_contain_text("revoked")
    expect(
        page.get_by_role("table", name="API keys").locator("tr", has_text="billing")
    ).to_contain_text("revoked")
    refused = _completion(server, key, MODEL)
    assert refused.status_code in (401, 403), refused.text
    still = _completion(server, spare, MODEL)
    assert still.status_code == 200, still.text

    # Suspend the tenant: the page shows it, its other key is refused.
    page.get_by_role("button", name="Suspend tenant").click()
    expect(page.locator("#tenant-status")).to_have_text("suspended")
    suspended = _completion(server, spare, MODEL)
    assert suspended.status_code == 403, suspended.text
    assert suspended.json()["error"]["code"] == "tenant_suspended"

    # The tenants list finds it by name, suspended.
    page.get_by_role("link", name="Tenants", exact=True).click()
    page.get_by_role("searchbox").fill(TENANT)
    page.get_by_role("button", name="Search").click()
    listed_row = page.get_by_role("table", name="Tenants").locator("tbody tr")
    expect(listed_row).to_have_count(1)
    expect(listed_row).to_contain_text("suspended")
    screenshot(page, "tenants")

    page.get_by_role("link", name="Engines").click()
    replica = page.locator(f'section[data-model="{MODEL}"] tbody tr').first
    expect(replica).to_contain_text("ready")
    screenshot(page, "engines")
    assert page.script_errors == []
    # The refusals the steps asked for, and nothing else.
    paths = sorted(
        {r.split(" ", 1)[0] + " " + r.split("127.0.0.1:")[1].split("/", 1)[1] for r in page.refused}
    )
    assert paths == ["400 admin/adapters", "401 console/api/session"], page.refused


def _next_day(day: str) -> str:
    return datetime.fromordinal(datetime.fromisoformat(day).toordinal() + 1).date().isoformat()


def _wait_for_usage(server: ConsoleServer, tenant_id: str, requests: int) -> None:
    """Usage rows reach the database within --usage-flush-interval of their request's end."""
    for _ in range(200):
        rows = httpx.get(
            f"{server.url}/admin/usage", params={"tenant_id": tenant_id}, headers=server.admin()
        ).json()["data"]
        if rows and rows[0]["num_requests"] >= requests:
            return
        time.sleep(0.05)
    raise AssertionError("the usage rows never reached the database")
