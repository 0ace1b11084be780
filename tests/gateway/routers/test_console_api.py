"""The admin REST the console reads, through HTTP on SQLite and PostgreSQL: the tenants list
in pages (limit, after, q) with this month's tokens, and /admin/usage by day and tenant with
the top groups and the rest as `other`, in JSON and CSV; 400s in OpenAI's shape naming the
parameter at fault; /v1/usage refusing a grouping by tenant."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from live_server import Server, admin_client
from usage_rows import insert_usage, usage_record

from tenants.ledger import UsageRecord

DAY1 = datetime(2026, 11, 29, 10, tzinfo=UTC)
DAY2 = DAY1 + timedelta(days=1)
SUMS = ("num_requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def _record(n: int, tenant: str, when: datetime, **fields: Any) -> UsageRecord:
    fields = {"key_id": "key_1", "model": "demo"} | fields
    return usage_record(f"console-{tenant}-{n}", tenant, when, **fields)


def _insert(server: Server, records: list[UsageRecord]) -> None:
    """Rows as the ledger writes them, straight into the server's database."""
    insert_usage(server.tenancy.settings.database_url, records)


def _error(resp: httpx.Response) -> dict[str, Any]:
    """The 400's error, its `param` without the item a schema error names (group_by.1)."""
    assert resp.status_code == 400, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return error | {"param": error["param"].split(".")[0]}


# -- GET /admin/tenants ---------------------------------------------------------------------------


def test_tenants_come_in_pages_with_this_months_tokens(tenancy_server: Server) -> None:
    with admin_client(tenancy_server) as admin:
        made = [
            admin.post("/admin/tenants", json={"name": name}).json()["id"]
            for name in ("Shop-One", "shop-two", "lab", "other_lab", "zeta")
        ]
        everyone = [tenancy_server.tenancy.tenant_id, *made]  # the server's own comes first

        whole = admin.get("/admin/tenants").json()  # no limit: every tenant, as before
        assert [t["id"] for t in whole["data"]] == everyone
        assert (whole["object"], whole["has_more"]) == ("list", False)
        assert (whole["first_id"], whole["last_id"]) == (everyone[0], everyone[-1])

        seen: list[str] = []
        params: dict[str, Any] = {"limit": 4}
        while True:
            page = admin.get("/admin/tenants", params=params)
            assert page.status_code == 200, page.text
            body = page.json()
            ids = [t["id"] for t in body["data"]]
            assert (body["first_id"], body["last_id"]) == (ids[0], ids[-1])
            seen += ids
            if not body["has_more"]:
                break
            params["after"] = body["last_id"]
        assert seen == everyone and len(seen) == len(set(seen))

        def names(**params: Any) -> list[str]:
            return [t["name"] for t in admin.get("/admin/tenants", params=params).json()["data"]]

        assert names(q="SHOP") == ["Shop-One", "shop-two"]
        assert names(q="lab") == ["lab", "other_lab"]
        assert names(q=made[4]) == ["zeta"]  # an exact id
        assert names(q="nobody") == []
        empty = admin.get("/admin/tenants", params={"q": "nobody", "limit": 3}).json()
        assert empty == {
            "object": "list",
            "data": [],
            "first_id": None,
            "last_id": None,
            "has_more": False,
        }

        unknown = _error(admin.get("/admin/tenants", params={"after": "ten_gone", "limit": 2}))
        assert (unknown["param"], unknown["code"]) == ("after", "invalid_value")
        for bad in ({"limit": 0}, {"limit": 1001}, {"q": "x" * 65}, {"after": "t" * 65}):
            assert _error(admin.get("/admin/tenants", params=bad))["param"] == next(iter(bad))
        # A NUL, which PostgreSQL refuses in any string, names no tenant: no 500.
        assert names(q="shop\x00") == []
        nul = _error(admin.get("/admin/tenants", params={"after": "ten_\x00", "limit": 2}))
        assert nul["param"] == "after"
        usage = admin.get("/admin/usage", params={"tenant_id": "\x00", "group_by": "day"})
        assert usage.status_code == 200 and usage.json()["data"] == []


def test_month_tokens_are_this_utc_months_prompt_and_completion(tenancy_server: Server) -> None:
    now = datetime.now(UTC)
    this_month = datetime(now.year, now.month, 1, tzinfo=UTC)
    with admin_client(tenancy_server) as admin:
        busy = admin.post("/admin/tenants", json={"name": "busy"}).json()["id"]
        quiet = admin.post("/admin/tenants", json={"name": "quiet"}).json()["id"]
        _insert(
            tenancy_server,
            [
                _record(1, busy, this_month, prompt_tokens=40, completion_tokens=2),
                _record(2, busy, this_month + timedelta(seconds=1), completion_tokens=7),
                _record(3, busy, this_month - timedelta(seconds=1)),  # last month
                _record(1, "ten_deleted", this_month),  # no tenant any more: not listed
            ],
        )
        listed = admin.get("/admin/tenants", params={"limit": 100}).json()["data"]
    tokens = {t["id"]: t["month_tokens"] for t in listed}
    assert tokens[busy] == 40 + 2 + 100 + 7
    assert tokens[quiet] == 0 and tokens[tenancy_server.tenancy.tenant_id] == 0
    assert "ten_deleted" not in tokens


# -- GET /admin/usage -----------------------------------------------------------------------------


def _console_rows(server: Server) -> None:
    """Two days; tokens (prompt + completion) over both: a 420, b 210, c 105, the server's own
    tenant 0 (none)."""
    _insert(
        server,
        [
            _record(1, "ten_a", DAY1),
            _record(2, "ten_a", DAY1 + timedelta(hours=1), adapter_name="sql"),
            _record(3, "ten_a", DAY2),
            _record(4, "ten_a", DAY2, key_id=None),
            _record(1, "ten_b", DAY1),
            _record(2, "ten_b", DAY2),
            _record(1, "ten_c", DAY2, adapter_name="sql"),
        ],
    )


def _sums(n: int) -> dict[str, int]:
    return {"num_requests": n, "prompt_tokens": 100 * n, "cached_tokens": 10 * n,
            "completion_tokens": 5 * n}  # fmt: skip


def test_usage_by_day_and_tenant_with_the_top_and_other(tenancy_server: Server) -> None:
    _console_rows(tenancy_server)
    with admin_client(tenancy_server) as admin:

        def data(params: list[tuple[str, Any]], **headers: str) -> Any:
            resp = admin.get("/admin/usage", params=params, headers=headers)
            assert resp.status_code == 200, resp.text
            return resp.text if headers else resp.json()["data"]

        pair = [("group_by", "day"), ("group_by", "tenant")]
        assert data(pair) == [
            {"day": "2026-11-29", "tenant": "ten_a"} | _sums(2),
            {"day": "2026-11-29", "tenant": "ten_b"} | _sums(1),
            {"day": "2026-11-30", "tenant": "ten_a"} | _sums(2),
            {"day": "2026-11-30", "tenant": "ten_b"} | _sums(1),
            {"day": "2026-11-30", "tenant": "ten_c"} | _sums(1),
        ]
        top = data([*pair, ("top", 1)])
        assert top == [
            {"day": "2026-11-29", "tenant": "ten_a", "other": False} | _sums(2),
            {"day": "2026-11-29", "tenant": None, "other": True} | _sums(1),
            {"day": "2026-11-30", "tenant": "ten_a", "other": False} | _sums(2),
            {"day": "2026-11-30", "tenant": None, "other": True} | _sums(2),
        ]
        totals = data([])[0]
        assert {k: sum(row[k] for row in top) for k in SUMS} == totals == _sums(7)

        # The base model (adapter null) has the most tokens: an ordinary row, not `other`.
        adapters = data([("group_by", "adapter"), ("top", 1)])
        assert adapters == [
            {"adapter": None, "other": False} | _sums(5),
            {"adapter": None, "other": True} | _sums(2),
        ]
        by_tenant = data([("group_by", "tenant"), ("top", 2), ("tenant_id", "ten_a")])
        assert by_tenant == [{"tenant": "ten_a", "other": False} | _sums(4)]

        text = data([*pair, ("top", 1)], accept="text/csv")
        assert text.splitlines()[0] == (
            "day,tenant,other,num_requests,prompt_tokens,cached_tokens,completion_tokens"
        )
        assert list(csv.DictReader(io.StringIO(text))) == [
            {k: "" if v is None else str(v).lower() for k, v in row.items()} for row in top
        ]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ([("group_by", "model"), ("group_by", "model")], "group_by"),
        ([("group_by", "day"), ("group_by", "day")], "group_by"),
        ([("group_by", "model"), ("group_by", "tenant")], "group_by"),
        ([("group_by", "day"), ("group_by", "model"), ("group_by", "key")], "group_by"),
        ([("group_by", "tenants")], "group_by"),
        ([("top", 3)], "top"),
        ([("group_by", "day"), ("top", 3)], "top"),
        ([("group_by", "model"), ("top", 0)], "top"),
        ([("group_by", "model"), ("top", 51)], "top"),
    ],
)
def test_groupings_that_cannot_be_asked_are_400s(
    tenancy_server: Server, params: list[tuple[str, Any]], param: str
) -> None:
    with admin_client(tenancy_server) as admin:
        assert _error(admin.get("/admin/usage", params=params))["param"] == param


def test_v1_usage_groups_by_day_and_more_but_never_by_tenant(tenancy_server: Server) -> None:
    """A key sees its own tenant only: a grouping by tenant is refused (400 naming group_by);
    the other groupings, the pair with day and top are the admin's."""
    server = tenancy_server
    own = server.tenancy.tenant_id
    _insert(
        server,
        [
            _record(1, own, DAY1),
            _record(2, own, DAY1, model="other"),
            _record(3, own, DAY2, model="third"),
            _record(1, "ten_a", DAY1, model="other"),
        ],
    )

    def get(params: list[tuple[str, Any]]) -> httpx.Response:
        return httpx.get(f"{server.base_url}/v1/usage", params=params, headers=server.headers)

    for params in ([("group_by", "tenant")], [("group_by", "day"), ("group_by", "tenant")]):
        assert _error(get(params))["param"] == "group_by"
    resp = get([("group_by", "day"), ("group_by", "model"), ("top", 1)])
    assert resp.status_code == 200, resp.text
    assert [(r["day"], r["model"], r["other"], r["num_requests"]) for r in resp.json()["data"]] == [
        ("2026-11-29", "demo", False, 1),  # demo, other, third: 105 tokens each; ties by name
        ("2026-11-29", None, True, 1),
        ("2026-11-30", None, True, 1),
    ]
