"""Batches of the Batch API (`/v1/batches`), per tenant, in the database: a batch and its lines
made in one transaction, read (with the counts and token sums of its lines so far), listed
newest first, cancelled, and finalized once.

A batch's life, as OpenAI's statuses name it:

    in_progress ──► finalizing ──► completed          every line answered (done or failed)
        │ └───────────────────────► expired            expires_at passed first
        └──► cancelling ──────────► cancelled          cancel asked

Each ending is finalized by one gateway: the first to set `finisher` (`begin_finish`, a
conditional update) writes the output and error files and ends the batch (`end_finish`, only
while its claim holds). A finisher that dies leaves its claim to lapse after the lease, and
another finalizes. Before an expired or cancelled batch is read for its files, its unfinished
lines are fenced (`fence_lines`): their status changes, so an answer that arrives afterwards
finds its claim gone and writes nothing (tenants/batch_lines.py).

Every read is scoped to a tenant: another tenant's batch id reads as missing (but `page_all`,
the admin's list across tenants). Times are UTC.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    and_,
    exists,
    func,
    insert,
    or_,
    select,
    true,
    tuple_,
    update,
)

from tenants.db import Database
from tenants.models import BatchLineRow, BatchRow, Tenant, utcnow

# The statuses of a batch whose lines may still run; and those it ends in.
RUNNING = ("validating", "in_progress")
ENDED = ("completed", "failed", "expired", "cancelled")
UNFINISHED_LINES = ("pending", "running")
INSERT_CHUNK = 500  # lines per INSERT statement
READ_CHUNK = 1000  # lines per read when finalizing

Ending = Literal["completed", "expired", "cancelled"]


class QueuedTokensExceeded(Exception):
    """A new batch would take the tenant's unfinished batches past its token cap."""

    def __init__(self, queued: int, adding: int, limit: int) -> None:
        super().__init__(f"{queued} tokens queued + {adding} > {limit}")
        self.queued = queued
        self.adding = adding
        self.limit = limit


@dataclass(frozen=True, slots=True)
class NewLine:
    line: int  # 1-based line number in the input file
    custom_id: str
    body: dict[str, Any]
    estimated_tokens: int


@dataclass(slots=True)
class LineTotals:
    """A batch's request counts and token sums: its lines', or as finalized."""

    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class StoredBatch:
    id: str
    tenant_id: str
    key_id: str | None
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str  # tenants.models.BATCH_STATUSES
    metadata: dict[str, str]
    output_file_id: str | None
    error_file_id: str | None
    totals: LineTotals
    created_at: datetime
    expires_at: datetime
    # The other moments OpenAI reports, by status name (in_progress_at, ...): None until then.
    moments: dict[str, datetime | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DueBatch:
    """A batch to finalize, and how it ends."""

    id: str
    tenant_id: str
    ending: Ending


@dataclass(frozen=True, slots=True)
class FinishedLine:
    """A line as finalizing reads it, in order."""

    line: int
    custom_id: str
    status: str  # tenants.models.LINE_STATUSES
    result: dict[str, Any] | None


MOMENTS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def _stored(row: BatchRow, live: LineTotals | None = None) -> StoredBatch:
    totals = live or LineTotals(
        row.num_total,
        row.num_completed,
        row.num_failed,
        row.prompt_tokens,
        row.cached_tokens,
        row.completion_tokens,
    )
    return StoredBatch(
        id=row.id,
        tenant_id=row.tenant_id,
        key_id=row.key_id,
        endpoint=row.endpoint,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        status=row.status,
        metadata=dict(row.meta),
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        totals=totals,
        created_at=row.created_at,
        expires_at=row.expires_at,
        moments={name: getattr(row, name) for name in MOMENTS},
    )


def _running(rows: list[BatchRow]) -> list[str]:
    """The ids of the batches not yet ended: their totals are read from their lines."""
    return [r.id for r in rows if r.status not in ENDED]


def _rowcount(result: Any) -> int:
    return cast(CursorResult[Any], result).rowcount


class BatchStore:
    """The `batches` table and a batch's lines as a whole, one session per call
    (tenants.batch_lines.LineClaims claims and answers single lines)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._postgresql = db.engine.dialect.name == "postgresql"

    # -- the API's side -----------------------------------------------------------------------

    async def create(
        self, batch: StoredBatch, lines: list[NewLine], token_limit: int | None
    ) -> StoredBatch:
        """Insert the batch (status in_progress) and its lines (pending) in one transaction.
        Raises QueuedTokensExceeded when `token_limit` is not None and the tenant's unfinished
        lines' estimates plus these would exceed it (creates of one tenant are serialised by
        its row on PostgreSQL; SQLite has one writer)."""
        adding = sum(line.estimated_tokens for line in lines)
        async with self.db.session() as session, session.begin():
            if token_limit is not None:
                if self._postgresql:
                    await session.execute(
                        select(Tenant.id).where(Tenant.id == batch.tenant_id).with_for_update()
                    )
                queued = await self._queued(session, batch.tenant_id)
                if queued + adding > token_limit:
                    raise QueuedTokensExceeded(queued, adding, token_limit)
            session.add(
                BatchRow(
                    id=batch.id,
                    tenant_id=batch.tenant_id,
                    key_id=batch.key_id,
                    endpoint=batch.endpoint,
                    input_file_id=batch.input_file_id,
                    completion_window=batch.completion_window,
                    status="in_progress",
                    meta=batch.metadata,
                    num_total=len(lines),
                    num_completed=0,
                    num_failed=0,
                    prompt_tokens=0,
                    cached_tokens=0,
                    completion_tokens=0,
                    created_at=batch.created_at,
                    in_progress_at=batch.created_at,
                    expires_at=batch.expires_at,
                )
            )
            await session.flush()
            for start in range(0, len(lines), INSERT_CHUNK):
                await session.execute(
                    insert(BatchLineRow),
                    [
                        {
                            "batch_id": batch.id,
                            "line": line.line,
                            "custom_id": line.custom_id,
                            "body": line.body,
                            "estimated_tokens": line.estimated_tokens,
                            "status": "pending",
                            "attempts": 0,
                            "prompt_tokens": 0,
                            "cached_tokens": 0,
                            "completion_tokens": 0,
                        }
                        for line in lines[start : start + INSERT_CHUNK]
                    ],
                )
        found = await self.get(batch.tenant_id, batch.id)
        assert found is not None
        return found

    async def queued_tokens(self, tenant_id: str) -> int:
        """The estimates of the tenant's lines not yet answered (what its cap counts)."""
        async with self.db.session() as session:
            return await self._queued(session, tenant_id)

    @staticmethod
    async def _queued(session: Any, tenant_id: str) -> int:
        line, batch = BatchLineRow, BatchRow
        query = (
            select(func.coalesce(func.sum(line.estimated_tokens), 0))
            .join(batch, batch.id == line.batch_id)
            .where(batch.tenant_id == tenant_id, line.status.in_(UNFINISHED_LINES))
        )
        return int(await session.scalar(query) or 0)

    async def get(self, tenant_id: str, batch_id: str) -> StoredBatch | None:
        """None for an unknown id or another tenant's."""
        async with self.db.session() as session:
            row = await session.scalar(
                select(BatchRow).where(BatchRow.id == batch_id, BatchRow.tenant_id == tenant_id)
            )
            if row is None:
                return None
            live = await self._live(session, _running([row]))
        return _stored(row, live.get(row.id))

    async def page(
        self, tenant_id: str, limit: int, after: str | None = None
    ) -> tuple[list[StoredBatch], bool]:
        """The tenant's batches newest first (created_at, then id), from the one after the
        batch `after` (another tenant's or an unknown id: from the start, as OpenAI does for
        a cursor it does not know), at most `limit`; and whether more follow."""
        mine = BatchRow.tenant_id == tenant_id
        return await self._page(mine, limit, after, cursor_scope=mine)

    async def page_all(
        self, statuses: Sequence[str] | None, limit: int, after: str | None = None
    ) -> tuple[list[StoredBatch], bool]:
        """Every tenant's batches (of these statuses, if given) newest first, paged as `page`
        pages one tenant's (the cursor any batch: one whose status changed since still marks
        the place): the admin's view across tenants."""
        scope = true() if statuses is None else BatchRow.status.in_(statuses)
        return await self._page(scope, limit, after, cursor_scope=true())

    async def _page(
        self,
        scope: ColumnElement[bool],
        limit: int,
        after: str | None,
        *,
        cursor_scope: ColumnElement[bool],
    ) -> tuple[list[StoredBatch], bool]:
        """The batches in `scope`, newest first, after the batch `after` if `cursor_scope`
        holds it (else from the start)."""
        row = BatchRow
        query = select(row).where(scope)
        async with self.db.session() as session:
            if after is not None:
                cursor = await session.scalar(select(row).where(row.id == after, cursor_scope))
                if cursor is not None:
                    position = tuple_(cursor.created_at, cursor.id)
                    query = query.where(tuple_(row.created_at, row.id) < position)
            query = query.order_by(row.created_at.desc(), row.id.desc()).limit(limit + 1)
            rows = list(await session.scalars(query))
            more = len(rows) > limit
            rows = rows[:limit]
            live = await self._live(session, _running(rows))
        return [_stored(r, live.get(r.id)) for r in rows], more

    @staticmethod
    async def _live(session: Any, ids: list[str]) -> dict[str, LineTotals]:
        """Counts and sums of these batches' lines, in one grouped query."""
        if not ids:
            return {}
        line = BatchLineRow
        query = (
            select(
                line.batch_id,
                line.status,
                func.count().label("n"),
                func.coalesce(func.sum(line.prompt_tokens), 0).label("prompt"),
                func.coalesce(func.sum(line.cached_tokens), 0).label("cached"),
                func.coalesce(func.sum(line.completion_tokens), 0).label("completion"),
            )
            .where(line.batch_id.in_(ids))
            .group_by(line.batch_id, line.status)
        )
        totals = {batch_id: LineTotals() for batch_id in ids}
        for found in await session.execute(query):
            t = totals[found.batch_id]
            t.total += int(found.n)
            if found.status == "done":
                t.completed += int(found.n)
            elif found.status in ("failed", "expired"):
                t.failed += int(found.n)
            t.prompt_tokens += int(found.prompt)
            t.cached_tokens += int(found.cached)
            t.completion_tokens += int(found.completion)
        return totals

    async def cancel(self, tenant_id: str, batch_id: str) -> StoredBatch | None:
        """A running batch becomes `cancelling` (a runner ends it `cancelled`); one cancelling
        or ended already stays as it is. None where get would answer None."""
        row = BatchRow
        async with self.db.session() as session, session.begin():
            await session.execute(
                update(row)
                .where(row.id == batch_id, row.tenant_id == tenant_id, row.status.in_(RUNNING))
                .values(status="cancelling", cancelling_at=utcnow())
                .execution_options(synchronize_session=False)
            )
        return await self.get(tenant_id, batch_id)

    # -- finalizing ---------------------------------------------------------------------------

    async def due(self, limit: int = 16) -> list[DueBatch]:
        """Batches to finalize now, each with how it ends: cancelling ones (cancelled), those
        past expires_at (expired), those whose every line is answered (completed), and those a
        finisher left (its claim lapsed). Not those another finisher holds."""
        row, line, now = BatchRow, BatchLineRow, utcnow()
        unclaimed = or_(row.finisher.is_(None), row.finish_until < now)
        unfinished = exists().where(line.batch_id == row.id, line.status.in_(UNFINISHED_LINES))
        query = (
            select(row.id, row.tenant_id, row.status, row.expires_at, (~unfinished).label("all"))
            .where(
                unclaimed,
                or_(
                    row.status.in_(("cancelling", "finalizing")),
                    and_(row.status.in_(RUNNING), or_(row.expires_at <= now, ~unfinished)),
                ),
            )
            .order_by(row.created_at)
            .limit(limit)
        )
        async with self.db.session() as session:
            found = (await session.execute(query)).all()
        due = []
        for batch_id, tenant_id, status, expires_at, answered in found:
            ending: Ending = "completed"
            if status == "cancelling":
                ending = "cancelled"
            elif status != "finalizing" and not answered and expires_at <= now:
                ending = "expired"
            due.append(DueBatch(batch_id, tenant_id, ending))
        return due

    async def begin_finish(self, due: DueBatch, finisher: str, lease: float) -> bool:
        """Claim the batch's finalization (True), unless another finisher holds it or it has
        moved on. A batch that completes shows `finalizing` from here."""
        row, now = BatchRow, utcnow()
        values: dict[str, Any] = {
            "finisher": finisher,
            "finish_until": now + timedelta(seconds=lease),
        }
        statuses: tuple[str, ...] = RUNNING + ("finalizing",)
        if due.ending == "completed":
            values |= {"status": "finalizing", "finalizing_at": now}
        elif due.ending == "cancelled":
            statuses = ("cancelling",)
        async with self.db.session() as session, session.begin():
            claimed = await session.execute(
                update(row)
                .where(
                    row.id == due.id,
                    row.status.in_(statuses),
                    or_(row.finisher.is_(None), row.finish_until < now),
                )
                .values(**values)
                .execution_options(synchronize_session=False)
            )
        return _rowcount(claimed) == 1

    async def fence_lines(self, batch_id: str, status: Literal["expired", "cancelled"]) -> None:
        """The batch's lines not answered yet take `status`: never run, and an answer that
        arrives for one afterwards is not written (its claim is gone)."""
        line = BatchLineRow
        async with self.db.session() as session, session.begin():
            await session.execute(
                update(line)
                .where(line.batch_id == batch_id, line.status.in_(UNFINISHED_LINES))
                .values(status=status, claimed_by=None, lease_until=None)
                .execution_options(synchronize_session=False)
            )

    async def lines(self, batch_id: str) -> AsyncIterator[FinishedLine]:
        """The batch's lines in order (line number), read a chunk at a time."""
        line, last = BatchLineRow, 0
        while True:
            async with self.db.session() as session:
                rows = (
                    await session.execute(
                        select(line.line, line.custom_id, line.status, line.result)
                        .where(line.batch_id == batch_id, line.line > last)
                        .order_by(line.line)
                        .limit(READ_CHUNK)
                    )
                ).all()
            for number, custom_id, status, result in rows:
                yield FinishedLine(int(number), custom_id, status, result)
            if len(rows) < READ_CHUNK:
                return
            last = int(rows[-1][0])

    async def totals(self, batch_id: str) -> LineTotals:
        """The counts and sums of the batch's lines as they stand."""
        async with self.db.session() as session:
            live = await self._live(session, [batch_id])
        return live.get(batch_id, LineTotals())

    async def end_finish(
        self,
        batch_id: str,
        finisher: str,
        status: Ending,
        totals: LineTotals,
        output_file_id: str | None,
        error_file_id: str | None,
    ) -> bool:
        """End the batch in `status` with its files and totals, if `finisher` still holds its
        finalization (False: another took it over, and this finisher's files are not the
        batch's)."""
        row = BatchRow
        async with self.db.session() as session, session.begin():
            ended = await session.execute(
                update(row)
                .where(row.id == batch_id, row.finisher == finisher)
                .values(
                    status=status,
                    output_file_id=output_file_id,
                    error_file_id=error_file_id,
                    num_total=totals.total,
                    num_completed=totals.completed,
                    num_failed=totals.failed,
                    prompt_tokens=totals.prompt_tokens,
                    cached_tokens=totals.cached_tokens,
                    completion_tokens=totals.completion_tokens,
                    finisher=None,
                    finish_until=None,
                    **{f"{status}_at": utcnow()},
                )
                .execution_options(synchronize_session=False)
            )
        return _rowcount(ended) == 1
