"""tenants/usage.py alone, on SQLite and PostgreSQL: sums over half-open ranges, groups in
their order, OpenAI's buckets (empty ones listed, pages and their cursors), and refusals that
name their parameter. Through HTTP: tests/gateway/routers/test_usage_api.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession
from usage_rows import usage_record

from tenants.db import Database, upgrade
from tenants.models import Usage
from tenants.usage import (
    DAY,
    CompletionsQuery,
    UsageQueryError,
    UsageTotals,
    completions_page,
    decode_page,
    encode_page,
    summarize_usage,
    tokens_used,
)

T0 = int(datetime(2026, 11, 29, 22, 0, tzinfo=UTC).timestamp())  # 22:00 UTC, a day's end


def _row(n: int, tenant: str, epoch: int, **fields: Any) -> dict[str, Any]:
    when = datetime.fromtimestamp(epoch, UTC)
    return usage_record(f"r-{tenant}-{n}", tenant, when, **fields).row()


ROWS = [
    _row(1, "ten_a", T0, endpoint="chat"),  # 22:00 day 1
    _row(2, "ten_a", T0 + 3600, adapter_name="sql", key_id="key_b"),  # 23:00 day 1
    _row(3, "ten_a", T0 + 7200, completion_tokens=50, endpoint="responses"),  # 00:00 day 2
    _row(4, "ten_b", T0 + 60, prompt_tokens=7, cached_tokens=0, completion_tokens=3),
]


def _with_rows(database_url: str, body: Callable[[AsyncSession], Awaitable[None]]) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                await session.execute(insert(Usage.__table__), ROWS)
            async with db.session() as session:
                await body(session)
        finally:
            await db.close()

    asyncio.run(run())


def test_sums_over_half_open_ranges_per_tenant(database_url: str) -> None:
    async def body(session: AsyncSession) -> None:
        everything = await summarize_usage(session)
        assert everything == [UsageTotals(None, 4, 307, 30, 63)]
        a = await summarize_usage(session, tenant_id="ten_a", start=T0, end=T0 + 7200)
        assert a == [UsageTotals(None, 2, 200, 20, 10)]  # 00:00 is the end: excluded
        empty = await summarize_usage(session, start=T0 + 10, end=T0 + 10)
        assert empty == [UsageTotals(None, 0, 0, 0, 0)]  # from = to: nothing, in one row
        assert await summarize_usage(session, tenant_id="ten_nobody") == [
            UsageTotals(None, 0, 0, 0, 0)
        ]

    _with_rows(database_url, body)


def test_groups_come_in_order_nulls_first(database_url: str) -> None:
    async def body(session: AsyncSession) -> None:
        days = await summarize_usage(session, tenant_id="ten_a", group_by="day")
        assert [(t.group, t.num_requests) for t in days] == [("2026-11-29", 2), ("2026-11-30", 1)]
        adapters = await summarize_usage(session, tenant_id="ten_a", group_by="adapter")
        assert [(t.group, t.num_requests) for t in adapters] == [(None, 2), ("sql", 1)]
        keys = await summarize_usage(session, group_by="key")
        assert [(t.group, t.num_requests) for t in keys] == [("key_a", 3), ("key_b", 1)]
        endpoints = await summarize_usage(session, tenant_id="ten_a", group_by="endpoint")
        assert [(t.group, t.completion_tokens) for t in endpoints] == [
            (None, 5),  # written before endpoints were recorded
            ("chat", 5),
            ("responses", 50),
        ]

    _with_rows(database_url, body)


def test_tokens_used_since_a_quotas_start(database_url: str) -> None:
    async def body(session: AsyncSession) -> None:
        since = datetime.fromtimestamp(T0 + 3600, UTC)
        assert await tokens_used(session, tenant_id="ten_a", since=since) == 105 + 150
        assert await tokens_used(session, tenant_id="ten_nobody", since=since) == 0

    _with_rows(database_url, body)


def test_openai_buckets_list_empty_ones_and_page_with_a_cursor(database_url: str) -> None:
    async def body(session: AsyncSession) -> None:
        query = CompletionsQuery(
            start_time=T0 + 1800, end_time=T0 + 4 * 3600, bucket_width="1h", limit=2
        )
        first = await completions_page(session, query)
        # Snapped down to 22:00; two buckets of four, the rest behind next_page.
        starts = [b["start_time"] for b in first["data"]]
        assert starts == [T0, T0 + 3600] and first["has_more"]
        # The range starts at 22:30: the requests of 22:00 and 22:01 are outside it, though
        # their bucket is not.
        assert first["data"][0]["results"] == []
        (one,) = first["data"][1]["results"]
        assert (one["num_model_requests"], one["input_tokens"], one["output_tokens"]) == (1, 100, 5)
        rest = await completions_page(session, replace(query, page=first["next_page"]))
        assert [b["start_time"] for b in rest["data"]] == [T0 + 7200, T0 + 3 * 3600]
        assert not rest["has_more"] and rest["next_page"] is None
        assert rest["data"][0]["results"][0]["output_tokens"] == 50
        assert rest["data"][1]["results"] == []  # an empty bucket, listed

    _with_rows(database_url, body)


def test_openai_groups_a_given_group_once(database_url: str) -> None:
    async def body(session: AsyncSession) -> None:
        page = await completions_page(
            session,
            CompletionsQuery(
                start_time=T0 - T0 % DAY,
                end_time=T0 - T0 % DAY + DAY,
                group_by=["project_id", "project_id", "adapter"],
            ),
        )
        results = page["data"][0]["results"]
        assert [(r["project_id"], r["adapter"], r["num_model_requests"]) for r in results] == [
            ("ten_a", None, 1),
            ("ten_a", "sql", 1),
            ("ten_b", None, 1),
        ]
        assert all(r["model"] is None and r["api_key_id"] is None for r in results)

    _with_rows(database_url, body)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"start_time": -1}, "start_time"),
        ({"start_time": 10, "end_time": 0}, "end_time"),
        ({"start_time": 0, "bucket_width": "2h"}, "bucket_width"),
        ({"start_time": 0, "limit": 32}, "limit"),
        ({"start_time": 0, "group_by": ["user_id"]}, "group_by"),
        ({"start_time": 0, "page": "page_MTA"}, "page"),  # 10: not on a day's start
        ({"start_time": 0, "page": "garbage"}, "page"),
    ],
)
def test_refusals_name_their_parameter(
    database_url: str, kwargs: dict[str, Any], param: str
) -> None:
    async def body(session: AsyncSession) -> None:
        with pytest.raises(UsageQueryError) as refused:
            await completions_page(session, CompletionsQuery(**kwargs), now=T0)
        assert refused.value.param == param

    _with_rows(database_url, body)


def test_a_page_cursor_round_trips_and_nothing_else_decodes() -> None:
    for start in (0, 60, T0, 253402300799):
        assert decode_page(encode_page(start)) == start
    for bad in ("", "page_", "page_!!", "page_" + "A" * 40, "MTA", "page_LTE"):  # "-1"
        with pytest.raises(UsageQueryError):
            decode_page(bad)
