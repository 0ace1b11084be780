"""summarize_usage's console groupings, tenants/usage.py alone, on SQLite and PostgreSQL: by
tenant, by day and one other grouping, and `top` with the rest merged into `other` rows whose
sums, with the top's, are the range's totals exactly; null groups (the base model, no key) in
the top and out of it; groupings that cannot be asked."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
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
    MAX_TOP,
    SUMMARY_GROUPS,
    UsageQueryError,
    UsageTotals,
    grouping,
    summarize_usage,
)

D1 = int(datetime(2026, 11, 29, tzinfo=UTC).timestamp())  # three days: the 29th, 30th, 1st
FIELDS = {"tenant": "tenant_id", "model": "model", "adapter": "adapter_name", "key": "key_id"}


def _row(n: int, epoch: int, **fields: Any) -> dict[str, Any]:
    fields = {"tenant_id": "ten_a"} | fields
    tenant = fields.pop("tenant_id")
    return usage_record(f"r-{n}", tenant, datetime.fromtimestamp(epoch, UTC), **fields).row()


# Tokens (prompt + completion) over the three days, by tenant: a 300, b 200, c 60, d 40.
# By adapter: null (the base model) 360, sql 200, chat 40. By key: key_a 500, null 100.
SMALL = [
    _row(1, D1 + 10, tenant_id="ten_a", prompt_tokens=90, completion_tokens=10),
    _row(2, D1 + DAY, tenant_id="ten_a", prompt_tokens=180, completion_tokens=20),
    _row(3, D1 + 20, tenant_id="ten_b", adapter_name="sql", prompt_tokens=150,
         completion_tokens=50),
    _row(4, D1 + 2 * DAY, tenant_id="ten_c", key_id=None, prompt_tokens=40, completion_tokens=20),
    _row(5, D1 + 2 * DAY + 5, tenant_id="ten_c", adapter_name="chat", key_id=None,
         prompt_tokens=0, completion_tokens=0),
    _row(6, D1 + 30, tenant_id="ten_d", adapter_name="chat", key_id=None, prompt_tokens=10,
         completion_tokens=2, model="other"),
    _row(7, D1 + DAY + 1, tenant_id="ten_d", adapter_name="chat", key_id=None,
         prompt_tokens=20, completion_tokens=8),
]  # fmt: skip


def _with_rows(
    database_url: str, rows: list[dict[str, Any]], body: Callable[[AsyncSession], Awaitable[None]]
) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                for start in range(0, len(rows), 500):
                    await session.execute(insert(Usage.__table__), rows[start : start + 500])
            async with db.session() as session:
                await body(session)
        finally:
            await db.close()

    asyncio.run(run())


def _view(totals: list[UsageTotals]) -> list[tuple[Any, ...]]:
    return [(t.day, t.group, t.other, t.num_requests, t.tokens) for t in totals]


def _sums(totals: list[UsageTotals]) -> tuple[int, int, int, int]:
    return (
        sum(t.num_requests for t in totals),
        sum(t.prompt_tokens for t in totals),
        sum(t.cached_tokens for t in totals),
        sum(t.completion_tokens for t in totals),
    )


def test_by_tenant_and_by_day_and_tenant(database_url: str) -> None:
    async def body(session: AsyncSession) -> None:
        tenants = await summarize_usage(session, group_by="tenant")
        assert [(t.group, t.num_requests, t.tokens) for t in tenants] == [
            ("ten_a", 2, 300),
            ("ten_b", 1, 200),
            ("ten_c", 2, 60),
            ("ten_d", 2, 40),
        ]
        assert all(t.day is None and not t.other for t in tenants)
        by_day = await summarize_usage(session, group_by=["day", "tenant"])
        assert _view(by_day) == [
            ("2026-11-29", "ten_a", False, 1, 100),
            ("2026-11-29", "ten_b", False, 1, 200),
            ("2026-11-29", "ten_d", False, 1, 12),
            ("2026-11-30", "ten_a", False, 1, 200),
            ("2026-11-30", "ten_d", False, 1, 28),
            ("2026-12-01", "ten_c", False, 2, 60),
        ]
        # Either order names the same grouping; a range and a tenant narrow it.
        assert await summarize_usage(session, group_by=["tenant", "day"]) == by_day
        narrowed = await summarize_usage(
            session, group_by=["day", "adapter"], tenant_id="ten_d", start=D1 + DAY
        )
        assert _view(narrowed) == [("2026-11-30", "chat", False, 1, 28)]
        # Day alone: the day is the group, as before.
        days = await summarize_usage(session, group_by=["day"])
        assert [(t.group, t.day, t.num_requests) for t in days] == [
            ("2026-11-29", "2026-11-29", 3),
            ("2026-11-30", "2026-11-30", 2),
            ("2026-12-01", "2026-12-01", 2),
        ]

    _with_rows(database_url, SMALL, body)


def test_top_keeps_the_biggest_groups_and_merges_the_rest(database_url: str) -> None:
    async def body(session: AsyncSession) -> None:
        top2 = await summarize_usage(session, group_by="tenant", top=2)
        assert _view(top2) == [
            (None, "ten_a", False, 2, 300),
            (None, "ten_b", False, 1, 200),
            (None, None, True, 4, 100),  # c and d
        ]
        daily = await summarize_usage(session, group_by=["day", "tenant"], top=2)
        assert _view(daily) == [
            ("2026-11-29", "ten_a", False, 1, 100),  # the top in rank order, not by the day's
            ("2026-11-29", "ten_b", False, 1, 200),
            ("2026-11-29", None, True, 1, 12),
            ("2026-11-30", "ten_a", False, 1, 200),
            ("2026-11-30", None, True, 1, 28),
            ("2026-12-01", None, True, 2, 60),  # a day without a top group: other only
        ]
        everything = await summarize_usage(session)
        for totals in (top2, daily):
            assert _sums(totals) == _sums(everything)
        # A top as big as the groups: no other row.
        assert not any(t.other for t in await summarize_usage(session, group_by="tenant", top=4))
        # Nothing in the range: no rows at all.
        assert await summarize_usage(session, group_by="tenant", top=3, start=D1 + 9 * DAY) == []

    _with_rows(database_url, SMALL, body)


def test_a_null_group_in_the_top_is_an_ordinary_row(database_url: str) -> None:
    """null is a value: the base model (adapter null) has the most tokens and is a top row,
    apart from the other row whose group is null too; out of the top, null merges."""

    async def body(session: AsyncSession) -> None:
        adapters = await summarize_usage(session, group_by="adapter", top=1)
        assert _view(adapters) == [(None, None, False, 3, 360), (None, None, True, 4, 240)]
        daily = await summarize_usage(session, group_by=["day", "adapter"], top=2)
        assert _view(daily) == [
            ("2026-11-29", None, False, 1, 100),
            ("2026-11-29", "sql", False, 1, 200),
            ("2026-11-29", None, True, 1, 12),
            ("2026-11-30", None, False, 1, 200),
            ("2026-11-30", None, True, 1, 28),
            ("2026-12-01", None, False, 1, 60),
            ("2026-12-01", None, True, 1, 0),
        ]
        keys = await summarize_usage(session, group_by="key", top=1)  # null key: not in the top
        assert _view(keys) == [(None, "key_a", False, 3, 500), (None, None, True, 4, 100)]
        nulls_tie = await summarize_usage(session, group_by="key", top=1, tenant_id="ten_c")
        assert _view(nulls_tie) == [(None, None, False, 2, 60)]  # the only group: null, in

    _with_rows(database_url, SMALL, body)


def test_ties_for_the_last_place_go_to_the_lower_value_null_first(database_url: str) -> None:
    rows = [
        _row(1, D1, model="b"),
        _row(2, D1, model="a"),
        _row(3, D1, model="c", prompt_tokens=1000),
        _row(4, D1, tenant_id="ten_t", adapter_name="x"),
        _row(5, D1, tenant_id="ten_t"),  # the base model, as many tokens as x
    ]

    async def body(session: AsyncSession) -> None:
        models = await summarize_usage(session, group_by="model", top=2, tenant_id="ten_a")
        assert [(t.group, t.other) for t in models] == [("c", False), ("a", False), (None, True)]
        adapters = await summarize_usage(session, group_by="adapter", top=1, tenant_id="ten_t")
        assert [(t.group, t.other, t.num_requests) for t in adapters] == [
            (None, False, 1),
            (None, True, 1),
        ]

    _with_rows(database_url, rows, body)


def _random_rows(seed: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        _row(
            i,
            D1 + rng.randrange(5 * DAY),
            tenant_id=f"ten_{rng.choice('abcdefgh')}",
            model=rng.choice(["m1", "m2", "m3"]),
            adapter_name=rng.choice([None, None, "a1", "a2", "a3", "a4"]),
            key_id=rng.choice([None, "key_1", "key_2", "key_3"]),
            endpoint=rng.choice([None, "chat", "completions", "responses"]),
            prompt_tokens=rng.randrange(1000),
            cached_tokens=rng.randrange(50),
            completion_tokens=rng.randrange(300),
        )
        for i in range(n)
    ]


RANDOM = _random_rows(7, 600)


def test_every_grouping_adds_up_to_the_totals_exactly(database_url: str) -> None:
    """Every grouping, alone and with day, with and without top, over a range that cuts days:
    the rows' sums are the ungrouped totals; the top groups are the biggest by tokens."""

    async def body(session: AsyncSession) -> None:
        start, end = D1 + DAY // 2, D1 + 4 * DAY + 7
        everything = await summarize_usage(session, start=start, end=end)
        expected = _sums(everything)
        assert expected[0] > 300
        in_range = [r for r in RANDOM if start <= r["created_epoch"] < end]
        for name in SUMMARY_GROUPS:
            for group_by in ([name], ["day", name]) if name != "day" else (["day"],):
                for top in (None, 1, 3) if name != "day" else (None,):
                    got = await summarize_usage(
                        session, start=start, end=end, group_by=group_by, top=top
                    )
                    assert _sums(got) == expected, (group_by, top)
                    if top is None or name not in FIELDS:
                        continue
                    tokens: Counter[Any] = Counter()
                    for r in in_range:
                        tokens[r[FIELDS[name]]] += r["prompt_tokens"] + r["completion_tokens"]
                    kept = {t.group for t in got if not t.other}
                    cut = sorted(tokens.values(), reverse=True)[top - 1]
                    assert len(kept) == top and all(tokens[g] >= cut for g in kept)
                    assert all(tokens[g] <= cut for g in set(tokens) - kept)

    _with_rows(database_url, RANDOM, body)


@pytest.mark.parametrize(
    ("group_by", "top", "param"),
    [
        (["user"], None, "group_by"),
        (["model", "model"], None, "group_by"),
        (["day", "day"], None, "group_by"),
        (["model", "tenant"], None, "group_by"),  # two, neither a day
        (["day", "model", "key"], None, "group_by"),
        (["day"], 3, "top"),  # top needs a grouping to rank
        ([], 3, "top"),
        (["model"], 0, "top"),
        (["model"], MAX_TOP + 1, "top"),
    ],
)
def test_groupings_that_cannot_be_asked(group_by: list[str], top: int | None, param: str) -> None:
    with pytest.raises(UsageQueryError) as refused:
        grouping(group_by, top)
    assert refused.value.param == param


def test_a_grouping_names_its_parts() -> None:
    assert grouping(None) == grouping([]) == grouping(()) != grouping("day")
    paired = grouping(["tenant", "day"], 5)
    assert (paired.by_day, paired.name, paired.top) == (True, "tenant", 5)
    assert grouping("adapter").by_day is False
