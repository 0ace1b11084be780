"""The Batches page and batch usage, in Chromium, over batches made the real way: files and
batches through the openai SDK against a live `loragate serve`, run by its runner. The page
shows a tenant's batches as `/v1/batches` has them (status, counts, progress), its output and
error files download byte for byte, a batch running now is listed across tenants and its
status follows it without a reload; the usage page stacks by endpoint and by batch with the
ledger's numbers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from batch_sdk import chat_line, start_batch, wait_ended
from console_server import MODEL, ConsoleServer, screenshot, serve, sign_in
from openai.types import Batch
from playwright.sync_api import expect

TENANT = "acme-analytics"
SLOW_LINES = 200  # lines of the batch that runs while the page is looked at (then cancelled)


@dataclass
class Batches:
    tenant_id: str
    client: openai.OpenAI
    done: Batch  # completed, every line answered: an output file
    refused: Batch  # completed, every line refused (the tenant's quota): an error file
    running: Batch  # in progress while the tests look (cancelled by one of them)


@pytest.fixture(scope="module")
def console_server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleServer]:
    """The conftest's server, but a changed quota reaches the batch runner at once and it runs
    two lines at a time (so that a batch stays in progress while the page is looked at)."""
    flags = ("--tenant-cache-ttl", "0", "--batch-max-concurrency", "2")
    with serve(demo_model_dir, tmp_path_factory.mktemp("console-batches"), *flags) as server:
        server.admin_token = server.loragate("admin", "token", "--ttl", "2h", "--subject", "ops")
        yield server


@pytest.fixture(scope="module")
def batches(console_server: ConsoleServer) -> Batches:
    admin = httpx.Client(base_url=console_server.url, headers=console_server.admin(), timeout=60)
    with admin:
        # No tokens this month: its first batch's lines are refused (an error file).
        made = admin.post("/admin/tenants", json={"name": TENANT, "monthly_token_quota": 0})
        assert made.status_code == 201, made.text
        tenant_id = made.json()["id"]
        key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "batch"}).json()["key"]
        client = openai.OpenAI(api_key=key, base_url=f"{console_server.url}/v1", timeout=60)
        refused = wait_ended(
            client, start_batch(client, [chat_line("q-0", "Hi", 4)], "quota.jsonl").id
        )
        lifted = admin.patch(f"/admin/tenants/{tenant_id}", json={"monthly_token_quota": None})
        assert lifted.status_code == 200, lifted.text
    questions = ["What is a LoRA?", "Name a prime.", "Say hello.", "Count to three."]
    answered = [chat_line(f"eval-{i}", text, 8) for i, text in enumerate(questions)]
    done = wait_ended(client, start_batch(client, answered, "nightly-eval.jsonl").id)
    # Long answers (the demo model's run to max_tokens), two at a time: seconds of work.
    slow = [chat_line(f"story-{i}", f"Story {i}", 160, ignore_eos=True) for i in range(SLOW_LINES)]
    running = start_batch(client, slow, "stories.jsonl")
    client.chat.completions.create(  # an interactive request beside them, for the usage page
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert (refused.status, refused.request_counts and refused.request_counts.failed) == (
        "completed",
        1,
    )
    assert done.status == "completed" and done.output_file_id is not None
    return Batches(tenant_id, client, done, refused, running)


def test_a_tenants_batches_their_progress_and_their_files(
    page: Any, console_server: ConsoleServer, batches: Batches
) -> None:
    client, running = batches.client, batches.running
    sign_in(page, console_server)
    page.get_by_role("link", name="Batches", exact=True).click()
    # Running now, across tenants: the slow batch, under its tenant's name.
    now = page.get_by_role("table", name="Batches running now")
    row = now.locator(f'tr[data-batch="{running.id}"]')
    expect(row).to_contain_text(TENANT)
    expect(row).to_contain_text("in progress")
    screenshot(page, "batches-running-now")

    page.get_by_label("Tenant", exact=True).select_option(label=TENANT)
    page.get_by_role("button", name="Show batches").click()
    assert page.url.endswith(f"#/batches?tenant={batches.tenant_id}")
    table = page.get_by_role("table", name=f"Batches of {TENANT}")
    rows = table.locator("tbody tr")
    expect(rows).to_have_count(3)
    # Newest first, as /v1/batches lists them.
    ids = [r.get_attribute("data-batch") for r in rows.all()]
    assert ids == [running.id, batches.done.id, batches.refused.id]

    done = table.locator(f'tr[data-batch="{batches.done.id}"]')
    cells = done.locator("td").all_inner_texts()
    assert cells[1:5] == ["completed", "4 / 4", "4", "0"]
    assert cells[6] == "Output"
    refused = table.locator(f'tr[data-batch="{batches.refused.id}"]')
    assert refused.locator("td").all_inner_texts()[1:7] == [
        "completed",
        "1 / 1",
        "0",
        "1",
        _created(batches.refused),
        "Errors",
    ]
    expect(done.locator("progress")).to_have_attribute("value", "4")

    # Downloads: the bytes the tenant gets from /v1/files, under the file's name.
    for batch, name, file_id in (
        (batches.done, "Output", batches.done.output_file_id),
        (batches.refused, "Errors", batches.refused.error_file_id),
    ):
        assert file_id is not None
        with page.expect_download() as download:
            page.get_by_role("link", name=f"{name} file of {batch.id}").click()
        got = Path(download.value.path()).read_bytes()
        assert got == client.files.content(file_id).content
        assert download.value.suggested_filename == client.files.retrieve(file_id).filename
    errors = [json.loads(one) for one in got.decode().splitlines()]
    assert [e["error"]["code"] for e in errors] == ["insufficient_quota"]

    # The running batch's progress moves on the page without a reload (5 s refresh).
    slow = table.locator(f'tr[data-batch="{running.id}"]')
    expect(slow.locator("td").nth(1)).to_have_text("in progress")
    first = int(slow.locator("progress").get_attribute("value") or 0)
    expect(slow.locator("progress")).not_to_have_attribute("value", str(first), timeout=15_000)
    screenshot(page, "batches")

    # Cancelled through the API: the page follows it to cancelled, keeping what finished.
    client.batches.cancel(running.id)
    expect(slow.locator("td").nth(1)).to_have_text("cancelled", timeout=20_000)
    ended = client.batches.retrieve(running.id)
    assert ended.request_counts is not None
    counts = ended.request_counts
    answered = f"{counts.completed + counts.failed} / {counts.total}"
    expect(slow.locator("td").nth(2)).to_have_text(answered)
    assert 0 < counts.completed < SLOW_LINES
    expect(page.get_by_text("No batch is running.")).to_be_visible()
    screenshot(page, "batches-ended")
    assert page.script_errors == []
    assert [r for r in page.refused if "/console/api/session" not in r] == []


def test_the_tenant_page_sets_its_batch_cap_and_links_to_its_batches(
    page: Any, console_server: ConsoleServer, batches: Batches
) -> None:
    sign_in(page, console_server)
    page.goto(f"{console_server.url}/console#/tenants/{batches.tenant_id}")
    cap = page.get_by_label("Queued batch tokens")
    expect(cap).to_have_attribute("placeholder", "server default")
    for typed, stored in (("500000", 500000), ("", None)):
        cap.fill(typed)
        page.get_by_role("button", name="Save limits").click()
        expect(page.get_by_role("status")).to_contain_text("Limits saved")
        expect(page.get_by_label("Queued batch tokens")).to_have_value(typed)
        tenant = httpx.get(
            f"{console_server.url}/admin/tenants/{batches.tenant_id}",
            headers=console_server.admin(),
        ).json()
        assert tenant["batch_token_limit"] == stored
        cap = page.get_by_label("Queued batch tokens")
    expect(page.get_by_role("link", name="Its batches")).to_be_visible()
    screenshot(page, "tenant-with-batches-link")
    page.get_by_role("link", name="Its batches").click()
    expect(page.get_by_role("table", name=f"Batches of {TENANT}")).to_be_visible()
    expect(page.get_by_label("Tenant", exact=True)).to_have_value(batches.tenant_id)
    assert page.script_errors == []


def test_usage_stacks_by_endpoint_and_by_batch(
    page: Any, console_server: ConsoleServer, batches: Batches
) -> None:
    batches.client.batches.cancel(batches.running.id)  # as it stands, if cancelled already
    wait_ended(batches.client, batches.running.id)
    sign_in(page, console_server)
    page.goto(f"{console_server.url}/console#/usage")
    table = page.get_by_role("table", name="Usage by day")
    expect(table.locator("tbody tr").first).to_be_visible()
    today = datetime.now(UTC).date()
    for group, names in (
        ("endpoint", {"batch", "chat"}),
        ("batch", {"(interactive)", batches.done.id, batches.running.id}),
    ):
        page.get_by_label("Stack by").select_option(group)
        page.get_by_role("button", name="Show").click()
        expect(table.locator("th").nth(1)).to_have_text(group.capitalize())
        rows = httpx.get(
            f"{console_server.url}/admin/usage",
            params=[
                ("from", today.isoformat()),
                ("to", (today + timedelta(days=1)).isoformat()),
                ("group_by", "day"),
                ("group_by", group),
                ("top", "10"),
            ],
            headers=console_server.admin(),
        ).json()["data"]
        legend = set(page.get_by_role("list", name="Chart legend").locator("li").all_inner_texts())
        assert names <= legend, legend
        shown = {
            cells[1]: [int(c.replace(",", "")) for c in cells[2:]]
            for cells in (
                r.locator("td").all_inner_texts() for r in table.locator("tbody tr").all()
            )
        }
        for row in rows:
            label = "other" if row["other"] else row[group]
            label = label or ("(interactive)" if group == "batch" else "(unrecorded)")
            assert shown[label] == [
                row["num_requests"],
                row["prompt_tokens"],
                row["completion_tokens"],
                row["prompt_tokens"] + row["completion_tokens"],
            ]
        if group == "batch":
            screenshot(page, "usage-by-batch")
    assert page.script_errors == []


def _created(batch: Batch) -> str:
    return datetime.fromtimestamp(batch.created_at, UTC).strftime("%Y-%m-%d %H:%M UTC")
