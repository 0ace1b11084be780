"""The admin REST over the Batch API (gateway/routers/admin_batches.py), against a live loragate
on the demo model whose batches were made the real way (files and batches through the openai
SDK, run by the server's runner): a tenant's batches paged newest first as `/v1/batches` shows
them, with their tenant and progress; its output file downloaded as an attachment, byte for
byte what its tenant downloads; every tenant's batches by status; an admin token required as on
every admin route; an unknown tenant or file, or another tenant's file through this tenant's
path, a 404 in OpenAI's error shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from batch_sdk import chat_line, start_batch, wait_ended
from joserfc import jwt
from joserfc.jwk import OctKey
from live_server import Server, admin_client, demo_server, new_tenant

from gateway.openai.batches.runner import RunnerOptions

UNKNOWN_FILE = "file-" + "0" * 32


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    runner = RunnerOptions(max_concurrency=8, lease=3.0, poll_interval=0.2)
    with demo_server(
        demo_model_dir, tmp_path_factory.mktemp("admin-batches"), batch_runner=runner
    ) as server:
        yield server


@pytest.fixture(scope="module")
def tenant(server: Server) -> tuple[str, openai.OpenAI]:
    tenant_id, key = new_tenant(server, "admin-batches")
    return tenant_id, server.client(key)


def test_a_tenants_batches_are_listed_as_its_tenant_sees_them_with_progress(
    server: Server, tenant: tuple[str, openai.OpenAI]
) -> None:
    tenant_id, client = tenant
    made = [
        start_batch(client, [chat_line(f"b{n}-{i}", f"b{n}-{i}", 2) for i in range(3)])
        for n in range(2)
    ]
    done = [wait_ended(client, batch.id) for batch in made]
    assert [batch.status for batch in done] == ["completed", "completed"]
    with admin_client(server) as admin:
        first = admin.get(f"/admin/tenants/{tenant_id}/batches", params={"limit": 1})
        assert first.status_code == 200, first.text
        page = first.json()
        assert [b["id"] for b in page["data"]] == [made[1].id] and page["has_more"]
        assert page["first_id"] == page["last_id"] == made[1].id
        rest = admin.get(
            f"/admin/tenants/{tenant_id}/batches", params={"after": page["last_id"]}
        ).json()
        assert [b["id"] for b in rest["data"]] == [made[0].id] and not rest["has_more"]
    shown = rest["data"][0]
    tenants_own = client.batches.retrieve(made[0].id).model_dump(mode="json")
    assert {k: v for k, v in shown.items() if k not in ("tenant_id", "progress")} == {
        k: v for k, v in tenants_own.items() if k in shown
    }
    assert (shown["tenant_id"], shown["progress"], shown["status"]) == (
        tenant_id,
        1.0,
        "completed",
    )
    assert shown["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert shown["output_file_id"] and shown["completed_at"] >= shown["in_progress_at"]


def test_a_batchs_output_file_downloads_as_its_tenant_downloads_it(
    server: Server, tenant: tuple[str, openai.OpenAI]
) -> None:
    tenant_id, client = tenant
    batch = wait_ended(
        client,
        start_batch(client, [chat_line("out-0", "out-0", 2), chat_line("out-1", "out-1", 2)]).id,
    )
    assert batch.output_file_id is not None
    with admin_client(server) as admin:
        got = admin.get(f"/admin/tenants/{tenant_id}/files/{batch.output_file_id}/content")
    assert got.status_code == 200, got.text
    assert got.content == client.files.content(batch.output_file_id).content
    assert sorted(json.loads(line)["custom_id"] for line in got.text.splitlines()) == [
        "out-0",
        "out-1",
    ]
    name = client.files.retrieve(batch.output_file_id).filename
    assert got.headers["content-disposition"] == f'attachment; filename="{name}"'
    assert got.headers["content-type"] == "application/octet-stream"


def test_every_tenants_batches_by_status(server: Server, tenant: tuple[str, openai.OpenAI]) -> None:
    tenant_id, client = tenant
    other_id, other_key = new_tenant(server, "admin-batches-other")
    other = server.client(other_key)
    quick = wait_ended(other, start_batch(other, [chat_line("quick", "quick", 1)]).id)
    slow = start_batch(
        client, [chat_line(f"slow-{i}", f"slow-{i}", 900, ignore_eos=True) for i in range(4)]
    )
    with admin_client(server) as admin:
        running = admin.get("/admin/batches", params={"status": "in_progress"}).json()
        assert slow.id in [b["id"] for b in running["data"]]
        assert {b["status"] for b in running["data"]} == {"in_progress"}
        assert 0.0 <= running["data"][0]["progress"] < 1.0
        everyone = admin.get("/admin/batches", params={"limit": 100}).json()["data"]
        owners = {b["id"]: b["tenant_id"] for b in everyone}
        assert (owners[slow.id], owners[quick.id]) == (tenant_id, other_id)
        assert [b["created_at"] for b in everyone] == sorted(
            (b["created_at"] for b in everyone), reverse=True
        )
        client.batches.cancel(slow.id)
        assert wait_ended(client, slow.id).status == "cancelled"
        both = admin.get(
            "/admin/batches", params=[("status", "cancelled"), ("status", "completed")]
        )
        assert slow.id in [b["id"] for b in both.json()["data"]]
        assert quick.id in [b["id"] for b in both.json()["data"]]
        wrong = admin.get("/admin/batches", params={"status": "running"})
        assert wrong.status_code == 400


def test_an_unknown_tenant_or_file_or_another_tenants_file_is_a_404(
    server: Server, tenant: tuple[str, openai.OpenAI]
) -> None:
    tenant_id, client = tenant
    batch = wait_ended(client, start_batch(client, [chat_line("mine", "mine", 1)]).id)
    stranger, _ = new_tenant(server, "admin-batches-stranger")
    with admin_client(server) as admin:
        unknown = admin.get("/admin/tenants/ten_unknown/batches")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "tenant_id"
        unknown_file = admin.get(f"/admin/tenants/ten_unknown/files/{batch.input_file_id}/content")
        assert unknown_file.status_code == 404
        assert admin.get(f"/admin/tenants/{stranger}/batches").json()["data"] == []
        for file_id in (batch.output_file_id, batch.input_file_id, UNKNOWN_FILE):
            # Another tenant's file through this tenant's path is a file that does not exist.
            got = admin.get(f"/admin/tenants/{stranger}/files/{file_id}/content")
            assert got.status_code == 404, got.text
            assert got.json() == {
                "error": {
                    "message": f"No such File object: {file_id}",
                    "type": "invalid_request_error",
                    "param": "file_id",
                    "code": "file_not_found",
                }
            }
        # Its own tenant's path reads it: the input file as it was uploaded.
        own = admin.get(f"/admin/tenants/{tenant_id}/files/{batch.input_file_id}/content")
        assert own.status_code == 200 and json.loads(own.text)["custom_id"] == "mine"


@pytest.mark.parametrize(
    "path",
    [
        "/admin/batches",
        "/admin/tenants/{tenant}/batches",
        "/admin/tenants/{tenant}/files/{file}/content",
    ],
)
def test_the_routes_need_an_admin_token(
    server: Server, tenant: tuple[str, openai.OpenAI], path: str
) -> None:
    tenant_id, client = tenant
    file_id = client.files.list().data[0].id
    url = server.base_url + path.format(tenant=tenant_id, file=file_id)
    missing = httpx.get(url)
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "invalid_admin_token")
    # A tenant's key is no admin token at all, not even for its own batches and files.
    key = {"Authorization": f"Bearer {client.api_key}"}
    as_tenant = httpx.get(url, headers=key)
    assert (as_tenant.status_code, as_tenant.json()["error"]["code"]) == (
        401,
        "invalid_admin_token",
    )
    signing = OctKey.import_key(server.tenancy.settings.admin_hs256_key())
    claims = {"sub": "viewer", "exp": int(time.time()) + 60, "scope": "read"}
    token = jwt.encode({"alg": "HS256"}, claims, signing)
    scoped = httpx.get(url, headers={"Authorization": f"Bearer {token}"})
    assert (scoped.status_code, scoped.json()["error"]["code"]) == (403, "insufficient_scope")
