"""tenants/batches.py and tenants/batch_lines.py on SQLite and PostgreSQL: a batch made with its
lines and read by its tenant only (counts and sums live from its lines), listed newest first,
the queued-token cap; lines claimed under a lease, disjoint between workers (concurrently on
PostgreSQL), tenants taken in turn, a lapsed lease reclaimed and the stale worker's answer
writing nothing, an answer written once with its usage row; cancel, and finalizing claimed by
one finisher, the unfinished lines fenced first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from tenants.batch_lines import LineAnswer, LineClaims
from tenants.batches import (
    BatchStore,
    DueBatch,
    LineTotals,
    NewLine,
    QueuedTokensExceeded,
    StoredBatch,
)
from tenants.db import Database, upgrade
from tenants.ledger import UsageRecord
from tenants.models import BatchLineRow, Usage
from tenants.tenants import create_tenant, delete_tenant, get_tenant

HOUR = timedelta(hours=1)
SERIAL = iter(range(1, 1_000_000))


def new_batch(tenant_id: str, expires_in: timedelta = HOUR) -> StoredBatch:
    now = datetime.now(UTC)
    return StoredBatch(
        id=f"batch_{next(SERIAL):032x}",
        tenant_id=tenant_id,
        key_id=None,
        endpoint="/v1/chat/completions",
        input_file_id="file-" + "0" * 32,
        completion_window="24h",
        status="in_progress",
        metadata={"job": "nightly"},
        output_file_id=None,
        error_file_id=None,
        totals=LineTotals(),
        created_at=now,
        expires_at=now + expires_in,
    )


def lines(count: int, tokens: int = 10) -> list[NewLine]:
    return [NewLine(n, f"req-{n}", {"model": "demo", "n": n}, tokens) for n in range(1, count + 1)]


def usage(
    tenant_id: str, batch_id: str, line: int, prompt: int = 3, completion: int = 2
) -> UsageRecord:
    return UsageRecord(
        request_id=f"{batch_id}-{line}",
        tenant_id=tenant_id,
        key_id=None,
        model="demo",
        adapter_name=None,
        adapter_sha256=None,
        prompt_tokens=prompt,
        cached_tokens=0,
        completion_tokens=completion,
        finish_reason="stop",
        status="ok",
        ttft=0.01,
        latency=0.02,
        created_at=datetime.now(UTC),
        endpoint="batch",
        batch_id=batch_id,
    )


def answer(tenant_id: str, batch_id: str, line: int) -> LineAnswer:
    result = {"id": f"batch_req_{line}", "custom_id": f"req-{line}", "response": {}, "error": None}
    return LineAnswer("done", result, 3, 0, 2, usage(tenant_id, batch_id, line))


def run(database_url: str, body: Callable[[Database, str, str], Awaitable[None]]) -> None:
    """Migrate, create two tenants, and run `body(db, tenant_a, tenant_b)`."""
    upgrade(database_url)

    async def main() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                a = await create_tenant(session, name="acme")
                b = await create_tenant(session, name="bravo")
            await body(db, a.id, b.id)
        finally:
            await db.close()

    asyncio.run(main())


async def usage_rows(db: Database, batch_id: str) -> list[Usage]:
    async with db.session() as session:
        return list(await session.scalars(select(Usage).where(Usage.batch_id == batch_id)))


def test_a_batch_is_made_read_by_its_tenant_only_and_listed(database_url: str) -> None:
    async def body(db: Database, a: str, b: str) -> None:
        store = BatchStore(db)
        made = await store.create(new_batch(a), lines(3), token_limit=None)
        assert (made.status, made.metadata, made.totals.total) == (
            "in_progress",
            {"job": "nightly"},
            3,
        )
        assert made.moments["in_progress_at"] == made.created_at
        assert await store.get(b, made.id) is None  # another tenant's: missing
        assert await store.cancel(b, made.id) is None
        later = [await store.create(new_batch(a), lines(1), None) for _ in range(3)]
        page, more = await store.page(a, 2)
        assert [x.id for x in page] == [later[2].id, later[1].id] and more
        page, more = await store.page(a, 10, after=later[1].id)
        assert [x.id for x in page] == [later[0].id, made.id] and not more
        assert await store.page(b, 10) == ([], False)

        # Its counts and sums come from its lines while it runs.
        claims = LineClaims(db)
        (first, *_) = await claims.claim("w1", 1, 60)
        assert first.batch_id == made.id and first.line == 1 and first.attempts == 1
        assert await claims.finish("w1", first.key, answer(a, made.id, 1))
        got = await store.get(a, made.id)
        assert got is not None
        assert (got.totals.completed, got.totals.failed, got.totals.prompt_tokens) == (1, 0, 3)

        # A tenant deleted takes its batches and their lines with it.
        async with db.session() as session, session.begin():
            tenant = await get_tenant(session, tenant_id=a)
            assert tenant is not None
            await delete_tenant(session, tenant=tenant)
        async with db.session() as session:
            assert await session.scalar(select(func.count()).select_from(BatchLineRow)) == 0

    run(database_url, body)


def test_every_tenants_batches_are_listed_by_status_for_the_admin(database_url: str) -> None:
    async def body(db: Database, a: str, b: str) -> None:
        store = BatchStore(db)
        first = await store.create(new_batch(a), lines(2), None)
        second = await store.create(new_batch(b), lines(1), None)
        third = await store.create(new_batch(a), lines(1), None)
        await store.cancel(b, second.id)
        page, more = await store.page_all(None, 2)
        assert [x.id for x in page] == [third.id, second.id] and more
        assert (page[0].tenant_id, page[1].tenant_id, page[1].status) == (a, b, "cancelling")
        page, more = await store.page_all(None, 2, after=second.id)
        assert [x.id for x in page] == [first.id] and not more
        assert page[0].totals.total == 2  # live from its lines, as the tenant's list reads it
        running, _ = await store.page_all(["in_progress"], 10)
        assert [x.id for x in running] == [third.id, first.id]
        # A cursor whose batch left the statuses asked for still marks the place.
        page, _ = await store.page_all(["in_progress"], 10, after=second.id)
        assert [x.id for x in page] == [first.id]
        assert await store.page_all(["completed"], 10) == ([], False)

    run(database_url, body)


def test_the_queued_token_cap_counts_unfinished_lines(database_url: str) -> None:
    async def body(db: Database, a: str, b: str) -> None:
        store, claims = BatchStore(db), LineClaims(db)
        made = await store.create(new_batch(a), lines(4, tokens=25), token_limit=100)
        with pytest.raises(QueuedTokensExceeded) as refused:
            await store.create(new_batch(a), lines(1, tokens=1), token_limit=100)
        assert (refused.value.queued, refused.value.adding, refused.value.limit) == (100, 1, 100)
        await store.create(new_batch(b), lines(1, tokens=100), token_limit=100)  # b's own
        for claimed in await claims.claim("w1", 10, 60):
            if claimed.tenant_id == a:
                assert await claims.finish("w1", claimed.key, answer(a, made.id, claimed.line))
        assert await store.queued_tokens(a) == 0
        await store.create(new_batch(a), lines(4, tokens=25), token_limit=100)

    run(database_url, body)


def test_claims_are_disjoint_and_tenants_take_turns(database_url: str) -> None:
    async def body(db: Database, a: str, b: str) -> None:
        store, claims = BatchStore(db), LineClaims(db)
        first = await store.create(new_batch(a), lines(5), None)
        second = await store.create(new_batch(a), lines(5), None)
        other = await store.create(new_batch(b), lines(2), None)
        taken = await claims.claim("w1", 4, 60)
        # Two tenants: two lines each, a's from its oldest batch first.
        assert sorted((c.batch_id, c.line) for c in taken) == sorted(
            [(first.id, 1), (first.id, 2), (other.id, 1), (other.id, 2)]
        )
        more = await claims.claim("w2", 10, 60, after_tenant=b)
        # b has none left: what was its share goes to a.
        assert [(c.batch_id, c.line) for c in more] == [(first.id, n) for n in (3, 4, 5)] + [
            (second.id, n) for n in range(1, 6)
        ]
        assert await claims.claim("w3", 10, 60) == []
        assert await claims.renew("w1", 60) == {c.key for c in taken}
        assert await claims.release("w2", [c.key for c in more[:2]]) == 2
        back = await claims.claim("w3", 10, 60)
        assert [(c.line, c.attempts) for c in back] == [(3, 1), (4, 1)]  # given back: not tries

    run(database_url, body)


def test_a_lapsed_lease_is_reclaimed_and_the_stale_answer_writes_nothing(
    database_url: str,
) -> None:
    async def body(db: Database, a: str, b: str) -> None:
        store, claims = BatchStore(db), LineClaims(db)
        made = await store.create(new_batch(a), lines(2), None)
        (stale,) = await claims.claim("dead", 1, lease=0)  # its lease lapses at once
        (taken,) = await claims.claim("alive", 1, 60)
        assert taken.key == stale.key and taken.attempts == 2
        assert await claims.renew("dead", 60) == set()  # the dead one's is gone
        assert not await claims.finish("dead", stale.key, answer(a, made.id, 1))
        assert await usage_rows(db, made.id) == []
        assert await claims.finish("alive", taken.key, answer(a, made.id, 1))
        assert not await claims.finish("alive", taken.key, answer(a, made.id, 1))  # once
        (row,) = await usage_rows(db, made.id)
        assert (row.request_id, row.endpoint, row.prompt_tokens) == (f"{made.id}-1", "batch", 3)

    run(database_url, body)


def test_a_group_writes_the_lines_whose_claims_hold_and_bills_only_those(
    database_url: str,
) -> None:
    async def body(db: Database, a: str, b: str) -> None:
        store, claims = BatchStore(db), LineClaims(db)
        made = await store.create(new_batch(a), lines(5), None)
        mine = await claims.claim("w1", 3, 60)
        lapsed = await claims.claim("w1", 2, lease=0)
        taken = await claims.claim("w2", 2, 60)  # the two whose leases lapsed
        assert {c.key for c in taken} == {c.key for c in lapsed}
        group = [(c.key, answer(a, made.id, c.line)) for c in [*lapsed[:1], *mine, *lapsed[1:]]]
        assert await claims.finish_many("w1", group) == [False, True, True, True, False]
        assert await claims.finish_many("w1", group[1:2]) == [False]  # once
        assert sorted(r.request_id for r in await usage_rows(db, made.id)) == [
            f"{made.id}-{c.line}" for c in mine
        ]
        async with db.session() as session:
            rows = {
                r.line: r
                for r in await session.scalars(
                    select(BatchLineRow).where(BatchLineRow.batch_id == made.id)
                )
            }
        for c in mine:
            assert rows[c.line].status == "done"
            assert rows[c.line].result == answer(a, made.id, c.line).result
            assert rows[c.line].completion_tokens == 2 and rows[c.line].finished_at is not None
        for c in taken:
            assert (rows[c.line].status, rows[c.line].claimed_by) == ("running", "w2")
            assert rows[c.line].result is None

    run(database_url, body)


def test_finalizing_is_claimed_once_and_fences_unfinished_lines(database_url: str) -> None:
    async def body(db: Database, a: str, b: str) -> None:
        store, claims = BatchStore(db), LineClaims(db)
        done = await store.create(new_batch(a), lines(2), None)
        for claimed in await claims.claim("w", 2, 60):
            assert await claims.finish("w", claimed.key, answer(a, done.id, claimed.line))
        expiring = await store.create(new_batch(a, expires_in=timedelta(0)), lines(2), None)
        cancelled = await store.create(new_batch(b), lines(2), None)
        (running,) = await claims.claim("w", 1, 60, after_tenant=a)
        assert running.batch_id == cancelled.id
        got = await store.cancel(b, cancelled.id)
        assert got is not None and got.status == "cancelling"
        assert got.moments["cancelling_at"] is not None

        due = {d.id: d for d in await store.due()}
        assert due == {
            done.id: DueBatch(done.id, a, "completed"),
            expiring.id: DueBatch(expiring.id, a, "expired"),
            cancelled.id: DueBatch(cancelled.id, b, "cancelled"),
        }
        assert await store.begin_finish(due[done.id], "f1", 60)
        assert not await store.begin_finish(due[done.id], "f2", 60)  # held
        finalizing = await store.get(a, done.id)
        assert finalizing is not None and finalizing.status == "finalizing"
        assert done.id not in {d.id for d in await store.due()}

        assert await store.begin_finish(due[cancelled.id], "f2", 60)
        await store.fence_lines(cancelled.id, "cancelled")
        assert not await claims.finish("w", running.key, answer(b, cancelled.id, 1))
        assert [x.status for x in [x async for x in store.lines(cancelled.id)]] == [
            "cancelled",
            "cancelled",
        ]
        totals = await store.totals(done.id)
        assert (totals.total, totals.completed, totals.prompt_tokens) == (2, 2, 6)
        assert not await store.end_finish(done.id, "f2", "completed", totals, "file-x", None)
        assert await store.end_finish(done.id, "f1", "completed", totals, "file-x", None)
        ended = await store.get(a, done.id)
        assert ended is not None and (ended.status, ended.output_file_id) == ("completed", "file-x")
        assert ended.moments["completed_at"] is not None and ended.totals == totals

        # A finisher that died: its claim lapses and another takes the batch over.
        assert await store.begin_finish(due[expiring.id], "dead", 0)
        assert [d.id for d in await store.due()] == [expiring.id]
        assert await store.begin_finish(due[expiring.id], "f3", 60)

    run(database_url, body)


def test_concurrent_claims_never_take_a_line_twice(postgres_url: str) -> None:
    """Eight workers claiming at once, each on its own connection pool, as gateways do."""

    async def body(db: Database, a: str, b: str) -> None:
        store = BatchStore(db)
        made = await store.create(new_batch(a), lines(200), None)
        await store.create(new_batch(b), lines(200), None)
        others = [Database(postgres_url) for _ in range(8)]
        try:

            async def worker(n: int) -> list[tuple[str, int]]:
                claims, got = LineClaims(others[n]), []
                while batch := await claims.claim(f"w{n}", 7, 60):
                    got += [c.key for c in batch]
                return got

            taken = await asyncio.gather(*(worker(n) for n in range(8)))
        finally:
            await asyncio.gather(*(o.close() for o in others))
        flat = [key for got in taken for key in got]
        assert len(flat) == len(set(flat)) == 400
        assert sum(1 for got in taken if got) >= 2  # they shared the work
        assert {n for batch_id, n in flat if batch_id == made.id} == set(range(1, 201))

    run(postgres_url, body)
