"""The admin console's tenants list, tenants/ alone, on SQLite and PostgreSQL: pages by
(created_at, id) that reach every tenant exactly once (ties in created_at included), a search
by name or id, an unknown cursor refused, and this month's tokens of a page in one query."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, insert

from tenants.db import Database, upgrade
from tenants.ledger import UsageRecord
from tenants.models import Tenant, Usage
from tenants.tenants import UnknownCursor, create_tenant, page_tenants
from tenants.usage import month_range, month_tokens

T0 = datetime(2026, 12, 1, 9, tzinfo=UTC)
NOW = int(datetime(2026, 12, 15, 12, tzinfo=UTC).timestamp())  # mid-December


def _with_db(database_url: str, body: Callable[[Database], Awaitable[None]]) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = Database(database_url)
        try:
            await body(db)
        finally:
            await db.close()

    asyncio.run(run())


async def _tenants(db: Database, names: list[str], created: list[datetime]) -> list[str]:
    async with db.session() as session, session.begin():
        made = [
            await create_tenant(session, name=name, created_at=at)
            for name, at in zip(names, created, strict=True)
        ]
        return [t.id for t in made]


def test_pages_reach_every_tenant_once_in_creation_order(database_url: str) -> None:
    """Eleven tenants, four of them created at the same instant (ordered by id among
    themselves): pages of 3 give each once, in (created_at, id) order, has_more until the
    last page."""

    async def body(db: Database) -> None:
        created = [T0 + timedelta(seconds=i) for i in range(7)] + [T0 + timedelta(hours=1)] * 4
        ids = await _tenants(db, [f"t{i:02d}" for i in range(11)], created)
        expected = sorted(zip(created, ids, strict=True))
        seen: list[str] = []
        after: str | None = None
        pages = 0
        while True:
            async with db.session() as session:
                page = await page_tenants(session, limit=3, after=after)
            pages += 1
            seen += [t.id for t in page.tenants]
            assert len(page.tenants) == (3 if page.has_more else 2)
            if not page.has_more:
                break
            after = page.tenants[-1].id
        assert seen == [tenant_id for _, tenant_id in expected]
        assert pages == 4
        async with db.session() as session:
            everything = await page_tenants(session)
            assert [t.id for t in everything.tenants] == seen and not everything.has_more
            exact = await page_tenants(session, limit=11)
            assert len(exact.tenants) == 11 and not exact.has_more
            past_the_end = await page_tenants(session, limit=5, after=seen[-1])
            assert past_the_end.tenants == [] and not past_the_end.has_more

    _with_db(database_url, body)


def test_a_tenant_created_meanwhile_shifts_no_page(database_url: str) -> None:
    async def body(db: Database) -> None:
        ids = await _tenants(db, ["a", "b", "c"], [T0, T0 + timedelta(1), T0 + timedelta(2)])
        async with db.session() as session:
            first = await page_tenants(session, limit=2)
        await _tenants(db, ["early"], [T0 - timedelta(1)])  # sorts before every page so far
        async with db.session() as session:
            second = await page_tenants(session, limit=2, after=first.tenants[-1].id)
        assert [t.id for t in first.tenants + second.tenants] == ids

    _with_db(database_url, body)


def test_q_matches_a_name_in_any_case_or_an_exact_id(database_url: str) -> None:
    async def body(db: Database) -> None:
        names = ["Acme-Prod", "acme_dev", "beta", "x_y", "xay"]
        ids = await _tenants(db, names, [T0 + timedelta(seconds=i) for i in range(5)])

        async def names_for(q: str, **kw: Any) -> list[str]:
            async with db.session() as session:
                return [t.name for t in (await page_tenants(session, q=q, **kw)).tenants]

        assert await names_for("ACME") == ["Acme-Prod", "acme_dev"]
        assert await names_for("me-p") == ["Acme-Prod"]
        assert await names_for("_") == ["acme_dev", "x_y"]  # a LIKE wildcard, taken literally
        assert await names_for("%") == []
        assert await names_for(ids[2]) == ["beta"]  # an id: exactly
        assert await names_for(ids[2][:-1]) == []  # not a part of one
        assert await names_for("") == names  # empty: no filter
        assert await names_for("acme", limit=1) == ["Acme-Prod"]
        async with db.session() as session:
            page = await page_tenants(session, q="acme", limit=1)
            assert page.has_more
            rest = await page_tenants(session, q="acme", limit=1, after=page.tenants[0].id)
            assert [t.name for t in rest.tenants] == ["acme_dev"] and not rest.has_more

    _with_db(database_url, body)


def test_an_unknown_cursor_is_refused(database_url: str) -> None:
    async def body(db: Database) -> None:
        await _tenants(db, ["a"], [T0])
        async with db.session() as session:
            with pytest.raises(UnknownCursor, match="ten_nobody"):
                await page_tenants(session, limit=1, after="ten_nobody")

    _with_db(database_url, body)


def _usage(n: int, tenant: str, at: datetime, prompt: int, completion: int) -> dict[str, Any]:
    return UsageRecord(
        request_id=f"r-{tenant}-{n}",
        tenant_id=tenant,
        key_id=None,
        model="demo",
        adapter_name=None,
        adapter_sha256=None,
        prompt_tokens=prompt,
        cached_tokens=1,
        completion_tokens=completion,
        finish_reason="stop",
        status="ok",
        ttft=None,
        latency=0.1,
        created_at=at,
    ).row()


def test_month_tokens_count_this_utc_month_of_each_tenant_in_one_query(
    database_url: str,
) -> None:
    first, stop = month_range(NOW)
    assert (first, stop) == (
        int(datetime(2026, 12, 1, tzinfo=UTC).timestamp()),
        int(datetime(2027, 1, 1, tzinfo=UTC).timestamp()),
    )
    december = datetime.fromtimestamp(first, UTC)
    rows = [
        _usage(1, "ten_a", december, 100, 10),  # the month's first second
        _usage(2, "ten_a", december + timedelta(days=14), 7, 3),
        _usage(3, "ten_a", december - timedelta(seconds=1), 1000, 1000),  # November
        _usage(4, "ten_a", datetime.fromtimestamp(stop, UTC), 1000, 1000),  # January
        _usage(5, "ten_b", december + timedelta(days=2), 50, 5),
        _usage(6, "ten_other", december, 9999, 9999),  # not asked for
    ]

    async def body(db: Database) -> None:
        async with db.session() as session, session.begin():
            await session.execute(insert(Usage.__table__), rows)
        statements: list[str] = []

        def count(*args: Any) -> None:
            statements.append(str(args[2]))

        event.listen(db.engine.sync_engine, "before_cursor_execute", count)
        async with db.session() as session:
            used = await month_tokens(session, tenant_ids=["ten_a", "ten_b", "ten_quiet"], now=NOW)
        event.remove(db.engine.sync_engine, "before_cursor_execute", count)
        assert used == {"ten_a": 120, "ten_b": 55, "ten_quiet": 0}
        assert len(statements) == 1  # one grouped query for the whole page
        async with db.session() as session:
            assert await month_tokens(session, tenant_ids=[], now=NOW) == {}
            # January's rows count in January
            january = await month_tokens(session, tenant_ids=["ten_a"], now=stop)
            assert january == {"ten_a": 2000}

    _with_db(database_url, body)


def test_month_tokens_of_more_tenants_than_an_in_list_holds(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_TENANTS_IN ids the month of every tenant is summed (still one query) and
    the answer is the same."""
    import tenants.usage

    monkeypatch.setattr(tenants.usage, "MAX_TENANTS_IN", 1)
    december = datetime.fromtimestamp(month_range(NOW)[0], UTC)

    async def body(db: Database) -> None:
        async with db.session() as session, session.begin():
            await session.execute(
                insert(Usage.__table__),
                [_usage(1, "ten_a", december, 1, 2), _usage(1, "ten_x", december, 5, 5)],
            )
        async with db.session() as session:
            used = await month_tokens(session, tenant_ids=["ten_a", "ten_b"], now=NOW)
        assert used == {"ten_a": 3, "ten_b": 0}

    _with_db(database_url, body)


def test_a_page_is_tenants_not_their_rows(database_url: str) -> None:
    """page_tenants answers ORM tenants a router can validate as it does today."""

    async def body(db: Database) -> None:
        await _tenants(db, ["solo"], [T0])
        async with db.session() as session:
            (tenant,) = (await page_tenants(session, limit=1)).tenants
        assert isinstance(tenant, Tenant) and tenant.created_at == T0

    _with_db(database_url, body)
