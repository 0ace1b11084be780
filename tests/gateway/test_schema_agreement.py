"""Where schemathesis (--checks all, a tenant key over /v1, an admin token over /admin) found
the OpenAPI schema and the routes disagreeing: each place answers as its schema says now."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
from live_server import Server, admin_client

from tenants.usage import MAX_PAGE


def test_an_empty_usage_range_is_an_empty_answer(tenancy_server: Server) -> None:
    """from = to, or to before from, is the empty half-open range: no rows, not a 400 (a
    constraint between two parameters that no OpenAPI schema can state)."""
    same = {"from": "2026-11-30", "to": "2026-11-30"}
    with admin_client(tenancy_server) as admin:
        for params in (same, {"from": "2026-11-30", "to": "2026-11-29"}):
            resp = admin.get("/admin/usage", params=params)
            assert resp.status_code == 200, resp.text
            assert all(row["num_requests"] == 0 for row in resp.json()["data"])
        for end_time in (1000, 999):
            page = admin.get(
                "/admin/usage/completions", params={"start_time": 1000, "end_time": end_time}
            )
            assert page.status_code == 200, page.text
            assert page.json()["data"] == [] and not page.json()["has_more"]
    resp = httpx.get(
        f"{tenancy_server.base_url}/v1/usage", params=same, headers=tenancy_server.headers
    )
    assert resp.status_code == 200, resp.text


def test_completions_take_a_group_given_twice_and_bound_the_page_as_the_schema_does(
    tenancy_server: Server,
) -> None:
    with admin_client(tenancy_server) as admin:
        twice = admin.get(
            "/admin/usage/completions",
            params=[("start_time", "0"), ("group_by", "model"), ("group_by", "model")],
        )
        assert twice.status_code == 200, twice.text
        schema = admin.get("/openapi.json").json()
        params = schema["paths"]["/admin/usage/completions"]["get"]["parameters"]
        page = next(p for p in params if p["name"] == "page")["schema"]
        page = next((s for s in page.get("anyOf", [page]) if s.get("type") == "string"), page)
        assert page["maxLength"] == MAX_PAGE  # the schema bounds a page as the server reads it
        too_long = "page_" + "A" * (MAX_PAGE - 4)
        resp = admin.get("/admin/usage/completions", params={"start_time": 0, "page": too_long})
        assert resp.status_code == 400


def test_tenant_limits_are_integers_not_strings_or_fractions(tenancy_server: Server) -> None:
    with admin_client(tenancy_server) as admin:
        for quota in ("1000", 10.5, True):
            resp = admin.post(
                "/admin/tenants", json={"name": "typed", "monthly_token_quota": quota}
            )
            assert resp.status_code == 400, (quota, resp.text)
            assert resp.json()["error"]["param"] == "monthly_token_quota"
        assert admin.post("/admin/tenants", json={"name": "typed", "rpm_limit": 7}).is_success


def test_a_key_is_never_born_expired(tenancy_server: Server) -> None:
    with admin_client(tenancy_server) as admin:
        tenant = admin.post("/admin/tenants", json={"name": "expiring"}).json()["id"]
        keys = f"/admin/tenants/{tenant}/keys"
        for expires in (2.6e-306, 0, "2.6e-306", " 1e3 ", "1970-01-01T00:00:00Z", "2020-05-01"):
            resp = admin.post(keys, json={"expires_at": expires})
            assert resp.status_code == 400, (expires, resp.text)
            assert resp.json()["error"]["param"] == "expires_at"
        later = (datetime.now(UTC) + timedelta(days=30)).isoformat()
        assert admin.post(keys, json={"expires_at": later}).status_code == 201
