"""The usage read side through HTTP, on SQLite and PostgreSQL: sums per group, CSV, OpenAI
Usage API buckets (read by the openai SDK's own types), /v1/usage scoped to the caller, and
400s in OpenAI's shape for parameters out of bounds."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import openai
import pytest
from live_server import Server, admin_client
from openai.types.admin.organization.usage_completions_response import UsageCompletionsResponse
from usage_rows import insert_usage, usage_record

from tenants.ledger import UsageRecord

MODEL = "demo"
DAY1 = datetime(2026, 11, 29, 22, 30, tzinfo=UTC)  # 22:30 and 23:30, then 00:30 the next day
HOUR = timedelta(hours=1)


def _record(n: int, tenant: str, when: datetime, **fields: Any) -> UsageRecord:
    fields = {"key_id": "key_1", "model": MODEL} | fields
    return usage_record(f"req-{tenant}-{n}", tenant, when, **fields)


def _insert(server: Server, records: list[UsageRecord]) -> None:
    """Rows as the ledger writes them, straight into the server's database."""
    insert_usage(server.tenancy.settings.database_url, records)


def _fixture_rows(server: Server) -> str:
    """Tenant A: four requests over two UTC days, two keys, an adapter; tenant B: one; the
    server's own tenant: two. Returns A's id."""
    a, b, own = "ten_a", "ten_b", server.tenancy.tenant_id
    _insert(
        server,
        [
            _record(1, a, DAY1),
            _record(2, a, DAY1 + HOUR, adapter_name="sql", adapter_sha256="f" * 64),
            _record(
                3,
                a,
                DAY1 + 2 * HOUR,
                key_id="key_2",
                model="other",
                prompt_tokens=7,
                endpoint="responses",
            ),
            _record(4, a, DAY1 + 2 * HOUR + timedelta(minutes=1), key_id=None, status="aborted"),
            _record(1, b, DAY1 + HOUR, prompt_tokens=1000),
            _record(1, own, DAY1, completion_tokens=1),
            _record(2, own, DAY1 + 2 * HOUR, completion_tokens=2, key_id=None),
        ],
    )
    return a


def _sums(n: int, prompt: int, cached: int, completion: int) -> dict[str, int]:
    return {
        "num_requests": n,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
    }


def test_admin_sums_per_group_and_range_and_csv(tenancy_server: Server) -> None:
    tenant = _fixture_rows(tenancy_server)
    with admin_client(tenancy_server) as admin:

        def data(**params: Any) -> list[dict[str, Any]]:
            resp = admin.get("/admin/usage", params=params)
            assert resp.status_code == 200, resp.text
            return resp.json()["data"]

        assert data() == [_sums(7, 100 * 6 + 7 + 1000 - 100, 70, 5 * 5 + 3)]
        assert data(tenant_id=tenant) == [_sums(4, 307, 40, 20)]
        assert data(tenant_id="ten_none") == [_sums(0, 0, 0, 0)]
        assert data(tenant_id=tenant, group_by="day") == [
            {"day": "2026-11-29"} | _sums(2, 200, 20, 10),
            {"day": "2026-11-30"} | _sums(2, 107, 20, 10),
        ]
        assert data(tenant_id=tenant, group_by="model") == [
            {"model": MODEL} | _sums(3, 300, 30, 15),
            {"model": "other"} | _sums(1, 7, 10, 5),
        ]
        assert data(tenant_id=tenant, group_by="adapter") == [
            {"adapter": None} | _sums(3, 207, 30, 15),
            {"adapter": "sql"} | _sums(1, 100, 10, 5),
        ]
        assert data(tenant_id=tenant, group_by="key") == [
            {"key": None} | _sums(1, 100, 10, 5),
            {"key": "key_1"} | _sums(2, 200, 20, 10),
            {"key": "key_2"} | _sums(1, 7, 10, 5),
        ]
        assert data(tenant_id=tenant, group_by="endpoint") == [
            {"endpoint": None} | _sums(3, 300, 30, 15),  # rows from before endpoints
            {"endpoint": "responses"} | _sums(1, 7, 10, 5),
        ]
        # Half-open ranges; a date is its midnight UTC; offsets are honoured.
        assert data(tenant_id=tenant, **{"from": "2026-11-30"}) == [_sums(2, 107, 20, 10)]
        assert data(tenant_id=tenant, to="2026-11-30") == [_sums(2, 200, 20, 10)]
        window = {"from": "2026-11-30T00:30:00+01:00", "to": "2026-11-29T23:31:00Z"}
        assert data(tenant_id=tenant, **window) == [_sums(1, 100, 10, 5)]  # 23:30 only
        naive = {"from": "2026-11-30T00:31:00"}  # UTC
        assert data(tenant_id=tenant, **naive) == [_sums(1, 100, 10, 5)]

        csv = admin.get(
            "/admin/usage",
            params={"tenant_id": tenant, "group_by": "adapter"},
            headers={"Accept": "text/csv"},
        )
        assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
        assert csv.text == (
            "adapter,num_requests,prompt_tokens,cached_tokens,completion_tokens\r\n"
            ",3,207,30,15\r\n"
            "sql,1,100,10,5\r\n"
        )
        plain = admin.get("/admin/usage", headers={"Accept": "text/csv"})
        assert plain.text.splitlines() == [
            "num_requests,prompt_tokens,cached_tokens,completion_tokens",
            "7,1507,70,28",
        ]


def test_openai_usage_api_buckets(tenancy_server: Server) -> None:
    tenant = _fixture_rows(tenancy_server)
    start = int((DAY1 - timedelta(minutes=30)).timestamp())  # 22:00
    with admin_client(tenancy_server) as admin:

        def page(**params: Any) -> dict[str, Any]:
            resp = admin.get("/admin/usage/completions", params={"start_time": start} | params)
            assert resp.status_code == 200, resp.text
            UsageCompletionsResponse.model_validate(resp.json())  # as the openai SDK reads it
            return resp.json()

        hourly = page(
            bucket_width="1h",
            end_time=start + 4 * 3600,
            tenant_id=tenant,
            **{"group_by[]": "model"},
        )
        assert hourly["object"] == "page" and not hourly["has_more"]
        assert hourly["next_page"] is None
        assert [(b["object"], b["start_time"], b["end_time"]) for b in hourly["data"]] == [
            ("bucket", start + h * 3600, start + (h + 1) * 3600) for h in range(4)
        ]
        results = [b["results"] for b in hourly["data"]]
        assert results[3] == []  # empty buckets are listed too
        first = results[0][0]
        assert first == {
            "object": "organization.usage.completions.result",
            "input_tokens": 100,
            "output_tokens": 5,
            "input_cached_tokens": 10,
            "input_audio_tokens": 0,
            "output_audio_tokens": 0,
            "num_model_requests": 1,
            "project_id": None,
            "user_id": None,
            "api_key_id": None,
            "model": MODEL,
            "batch": None,
            "adapter": None,
        }
        assert [(r["model"], r["num_model_requests"]) for r in results[2]] == [
            (MODEL, 1),
            ("other", 1),
        ]

        grouped = page(
            bucket_width="1d", end_time=start + 2 * 3600, group_by=["project_id", "api_key_id"]
        )
        (day,) = grouped["data"]
        assert {(r["project_id"], r["api_key_id"]): r["input_tokens"] for r in day["results"]} == {
            (tenant, "key_1"): 200,
            ("ten_b", "key_1"): 1000,
            (tenancy_server.tenancy.tenant_id, "key_1"): 100,
        }  # one bucket, 2026-11-29: the range ends at midnight

        # Pages of two one-minute buckets: every row exactly once across the pages.
        seen, cursor, pages = 0, None, 0
        while True:
            params: dict[str, Any] = {"bucket_width": "1m", "limit": 2, "tenant_id": tenant}
            params |= {"end_time": start + 3 * 3600}
            got = page(**params, **({"page": cursor} if cursor else {}))
            pages += 1
            assert len(got["data"]) <= 2
            seen += sum(r["num_model_requests"] for b in got["data"] for r in b["results"])
            if not got["has_more"]:
                break
            cursor = got["next_page"]
        assert seen == 4 and pages == 90

        # The openai SDK's admin client reads the same page at OpenAI's own path.
        client = openai.OpenAI(
            base_url=f"{tenancy_server.base_url}/v1",
            api_key="unused",
            admin_api_key=tenancy_server.tenancy.admin_token,
        )
        sdk = client.admin.organization.usage.completions(
            start_time=start, end_time=start + 2 * 3600, bucket_width="1d", group_by=["project_id"]
        )
        assert sdk.model_dump(exclude_unset=True) == UsageCompletionsResponse.model_validate(
            page(bucket_width="1d", end_time=start + 2 * 3600, group_by=["project_id"])
        ).model_dump(exclude_unset=True)
        tenant_key = openai.OpenAI(
            base_url=f"{tenancy_server.base_url}/v1",
            api_key="unused",
            admin_api_key=tenancy_server.tenancy.api_key,
        )
        with pytest.raises(openai.AuthenticationError):  # a tenant's key is no admin token
            tenant_key.admin.organization.usage.completions(start_time=start)


def test_v1_usage_is_the_callers_tenant_only(tenancy_server: Server) -> None:
    _fixture_rows(tenancy_server)
    server = tenancy_server
    resp = httpx.get(f"{server.base_url}/v1/usage", headers=server.headers)
    assert resp.status_code == 200
    assert resp.json() == {"object": "list", "data": [_sums(2, 200, 20, 3)]}
    by_key = httpx.get(
        f"{server.base_url}/v1/usage", params={"group_by": "key"}, headers=server.headers
    ).json()["data"]
    assert by_key == [{"key": None} | _sums(1, 100, 10, 2), {"key": "key_1"} | _sums(1, 100, 10, 1)]
    spoof = httpx.get(
        f"{server.base_url}/v1/usage", params={"tenant_id": "ten_a"}, headers=server.headers
    )
    assert spoof.status_code == 400 and spoof.json()["error"]["param"] == "tenant_id"
    assert httpx.get(f"{server.base_url}/v1/usage").status_code == 401
    admin = httpx.get(f"{server.base_url}/admin/usage", headers=server.headers)
    assert admin.status_code == 401  # a tenant's key is no admin token


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/admin/usage", {"from": "1700000000"}),  # ISO 8601 only
        ("/admin/usage", {"from": "yesterday"}),
        ("/admin/usage", {"from": "-5.7e-102"}),  # a number, even with an exponent
        ("/admin/usage", {"to": "2026-13-01"}),
        ("/admin/usage", {"group_by": "user"}),
        ("/admin/usage/completions", {}),  # start_time is required
        ("/admin/usage/completions", {"start_time": -1}),
        ("/admin/usage/completions", {"start_time": "soon"}),
        ("/admin/usage/completions", {"start_time": 0, "end_time": 253402300801}),  # year 10000
        ("/admin/usage/completions", {"start_time": 0, "bucket_width": "2h"}),
        ("/admin/usage/completions", {"start_time": 0, "limit": 32}),  # 1d: at most 31
        ("/admin/usage/completions", {"start_time": 0, "limit": 0}),
        ("/admin/usage/completions", {"start_time": 0, "group_by": "user_id"}),
        ("/admin/usage/completions", {"start_time": 0, "page": "page_garbage!"}),
        ("/admin/usage/completions", {"start_time": 0, "page": "page_MTA"}),  # not aligned
    ],
)
def test_bad_parameters_are_400s_in_openai_shape(
    tenancy_server: Server, path: str, params: dict[str, Any]
) -> None:
    with admin_client(tenancy_server) as admin:
        resp = admin.get(path, params=params)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]


def test_requests_are_metered_into_v1_usage(tenancy_server: Server) -> None:
    """End to end: the gateway's requests become ledger rows that /v1/usage sums."""
    server = tenancy_server
    client = server.client()
    replies = [
        client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3) for _ in range(3)
    ]
    prompt = sum(r.usage.prompt_tokens for r in replies)
    completion = sum(r.usage.completion_tokens for r in replies)
    deadline = time.monotonic() + 30
    while True:
        data = httpx.get(f"{server.base_url}/v1/usage", headers=server.headers).json()["data"]
        if data[0]["num_requests"] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert data[0]["num_requests"] == 3
    assert data[0]["prompt_tokens"] == prompt
    assert data[0]["completion_tokens"] == completion
