"""A batch's lines as work: claimed by a gateway under a lease, the lease renewed while they
run, and each answer written once, with its usage row, while the claim still holds.

    pending ──claim──► running (claimed_by = me, lease_until) ──finish──► done | failed
       ▲                  │  lease lapsed: any gateway may claim it again
       └────release───────┘  (shutdown, an engine that could not take it now)

A claim is one `UPDATE ... WHERE status = 'pending' OR (status = 'running' AND lease_until <
now) ... RETURNING`, over a subquery that takes the lines `FOR UPDATE SKIP LOCKED` on
PostgreSQL, so gateways sharing the database take disjoint lines without waiting on each
other (SQLite has one writer). A finished line is written in ONE transaction with its usage
row (insert-or-ignore on request_id), only `WHERE claimed_by = me AND status = 'running'`: a
gateway whose claim lapsed and was taken over, or whose batch was cancelled or expired
meanwhile (tenants/batches.py fences those lines), writes nothing. So whatever stops a
gateway, and wherever, a line is answered once in the output and billed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import (
    CursorResult,
    Table,
    and_,
    bindparam,
    exists,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from tenants.db import Database
from tenants.ledger import UsageRecord
from tenants.models import BatchLineRow, BatchRow, Usage, utcnow

LineKey = tuple[str, int]  # (batch id, line number)


@dataclass(frozen=True, slots=True)
class ClaimedLine:
    """A line this gateway now runs, with what it needs of its batch."""

    batch_id: str
    line: int
    tenant_id: str
    key_id: str | None
    endpoint: str  # the batch's url: /v1/chat/completions, /v1/completions, /v1/responses
    custom_id: str
    body: dict[str, Any]
    estimated_tokens: int
    attempts: int  # claims of this line that were not given back, this one included

    @property
    def key(self) -> LineKey:
        return (self.batch_id, self.line)


@dataclass(frozen=True, slots=True)
class LineAnswer:
    """What a finished line writes: its status, its output line, its usage figures, and the
    usage row (None: it never reached the engine, so nothing is billed)."""

    status: str  # "done" or "failed"
    result: dict[str, Any]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    usage: UsageRecord | None = None


def _claimable(now: Any) -> Any:
    line = BatchLineRow
    return or_(line.status == "pending", and_(line.status == "running", line.lease_until < now))


class LineClaims:
    """Claims on the `batch_lines` table, one session per call."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._postgresql = db.engine.dialect.name == "postgresql"
        dialect = postgresql if self._postgresql else sqlite
        self._insert_usage = dialect.insert(Usage.__table__).on_conflict_do_nothing(
            index_elements=["request_id"]
        )
        # A line's answer by its key, for many lines in one executemany.
        table = cast(Table, BatchLineRow.__table__)
        self._write_answer = update(table).where(
            table.c.batch_id == bindparam("key_batch_id"), table.c.line == bindparam("key_line")
        )

    async def claim(
        self, worker: str, limit: int, lease: float, after_tenant: str | None = None
    ) -> list[ClaimedLine]:
        """Up to `limit` lines of running batches (oldest batch first within a tenant), the
        tenants taken in turn starting after `after_tenant` (by id, round): each tenant with
        lines to run gets an equal share, and what one cannot use goes to the others."""
        if limit < 1:
            return []
        batches = await self._runnable()
        tenants = sorted({tenant for _, tenant, _, _ in batches})
        if not tenants:
            return []
        first = next((i for i, t in enumerate(tenants) if after_tenant and t > after_tenant), 0)
        order = tenants[first:] + tenants[:first]
        claimed: list[ClaimedLine] = []
        spare, full = 0, []
        for i, tenant in enumerate(order):
            share = limit // len(order) + (1 if i < limit % len(order) else 0)
            if share == 0:
                break  # the tenants after these get the next claim's first turns
            mine = [b for b in batches if b[1] == tenant]
            got = await self._claim_tenant(worker, mine, share, lease)
            claimed += got
            spare += share - len(got)
            if len(got) == share:
                full.append(mine)
        for mine in full:  # what a tenant could not use goes to those that had more
            if spare == 0:
                break
            got = await self._claim_tenant(worker, mine, spare, lease)
            claimed += got
            spare -= len(got)
        return claimed

    async def _runnable(self) -> list[tuple[str, str, str | None, str]]:
        """(batch id, tenant id, key id, endpoint) of running batches with lines to claim,
        oldest first."""
        batch, line, now = BatchRow, BatchLineRow, utcnow()
        query = (
            select(batch.id, batch.tenant_id, batch.key_id, batch.endpoint)
            .where(
                batch.status == "in_progress",
                batch.expires_at > now,
                exists().where(line.batch_id == batch.id, _claimable(now)),
            )
            .order_by(batch.created_at, batch.id)
        )
        async with self.db.session() as session:
            return [tuple(r) for r in (await session.execute(query)).all()]  # type: ignore[misc]

    async def _claim_tenant(
        self,
        worker: str,
        batches: list[tuple[str, str, str | None, str]],
        count: int,
        lease: float,
    ) -> list[ClaimedLine]:
        claimed: list[ClaimedLine] = []
        for batch_id, tenant_id, key_id, endpoint in batches:
            if len(claimed) >= count:
                break
            rows = await self._claim_batch(worker, batch_id, count - len(claimed), lease)
            claimed += [
                ClaimedLine(
                    batch_id, int(n), tenant_id, key_id, endpoint, custom_id, body, est, tries
                )
                for n, custom_id, body, est, tries in rows
            ]
        return claimed

    async def _claim_batch(self, worker: str, batch_id: str, count: int, lease: float) -> list[Any]:
        line, now = BatchLineRow, utcnow()
        pick = (
            select(line.line)
            .where(line.batch_id == batch_id, _claimable(now))
            .order_by(line.line)
            .limit(count)
        )
        if self._postgresql:
            # Materialized, so that the LIMIT holds: a subquery under IN may be run again as
            # the update proceeds, taking more lines than asked for.
            picked = (
                pick.with_for_update(skip_locked=True)
                .cte("picked")
                .prefix_with("MATERIALIZED", dialect="postgresql")
            )
            chosen = line.line == picked.c.line
        else:
            chosen = line.line.in_(pick.scalar_subquery())
        # The claimable test again on the row updated: on PostgreSQL a line another claim
        # took between the subquery's snapshot and the update is re-checked and left out.
        claim = (
            update(line)
            .where(line.batch_id == batch_id, chosen, _claimable(now))
            .values(
                status="running",
                claimed_by=worker,
                lease_until=now + timedelta(seconds=lease),
                attempts=line.attempts + 1,
            )
            .returning(line.line, line.custom_id, line.body, line.estimated_tokens, line.attempts)
            .execution_options(synchronize_session=False)
        )
        async with self.db.session() as session, session.begin():
            rows = (await session.execute(claim)).all()
        return sorted(rows, key=lambda r: r[0])

    async def renew(self, worker: str, lease: float) -> set[LineKey]:
        """Extend the lease of every line this worker runs; the lines that are still its own
        (a line missing from the answer was taken over, or its batch cancelled or expired)."""
        line = BatchLineRow
        renew = (
            update(line)
            .where(line.claimed_by == worker, line.status == "running")
            .values(lease_until=utcnow() + timedelta(seconds=lease))
            .returning(line.batch_id, line.line)
            .execution_options(synchronize_session=False)
        )
        async with self.db.session() as session, session.begin():
            return {(b, int(n)) for b, n in (await session.execute(renew)).all()}

    async def finish(self, worker: str, key: LineKey, answer: LineAnswer) -> bool:
        """Write the line's answer and its usage row in one transaction, if the worker's claim
        still holds (True); otherwise nothing is written (False)."""
        return (await self.finish_many(worker, [(key, answer)]))[0]

    async def finish_many(
        self, worker: str, answers: list[tuple[LineKey, LineAnswer]]
    ) -> list[bool]:
        """`finish` for several lines in one transaction (one commit, one fsync) of three
        statements whatever their number: the lines whose claim still holds taken (locked),
        their answers written, their usage rows inserted. A line whose claim was lost is not
        written and not billed."""
        if not answers:
            return []
        line = BatchLineRow
        async with self.db.session() as session, session.begin():
            # A write that changes nothing, to hold these lines (PostgreSQL's row locks,
            # SQLite's one writer) until the commit: no claim changes under the next two.
            held = await session.execute(
                update(line)
                .where(
                    tuple_(line.batch_id, line.line).in_([key for key, _ in answers]),
                    line.claimed_by == worker,
                    line.status == "running",
                )
                .values(claimed_by=worker)
                .returning(line.batch_id, line.line)
                .execution_options(synchronize_session=False)
            )
            mine = {(batch_id, number) for batch_id, number in held.all()}
            written = [(key, answer) for key, answer in answers if key in mine]
            if written:
                now = utcnow()
                await session.execute(
                    self._write_answer,
                    [
                        {
                            "key_batch_id": batch_id,
                            "key_line": number,
                            "status": answer.status,
                            "result": answer.result,
                            "prompt_tokens": answer.prompt_tokens,
                            "cached_tokens": answer.cached_tokens,
                            "completion_tokens": answer.completion_tokens,
                            "lease_until": None,
                            "finished_at": now,
                        }
                        for (batch_id, number), answer in written
                    ],
                )
            usage = [answer.usage.row() for _, answer in written if answer.usage is not None]
            if usage:
                await session.execute(self._insert_usage, usage)
        return [key in mine for key, _ in answers]

    async def release(self, worker: str, keys: list[LineKey]) -> int:
        """Give lines this worker runs back (pending, for any gateway to claim now); how many.
        The claim given back does not count as an attempt: only a claim that lapsed does (its
        gateway died, maybe because of the line)."""
        if not keys:
            return 0
        line = BatchLineRow
        async with self.db.session() as session, session.begin():
            released = await session.execute(
                update(line)
                .where(
                    tuple_(line.batch_id, line.line).in_(keys),
                    line.claimed_by == worker,
                    line.status == "running",
                )
                .values(
                    status="pending",
                    claimed_by=None,
                    lease_until=None,
                    attempts=line.attempts - 1,
                )
                .execution_options(synchronize_session=False)
            )
        return cast(CursorResult[Any], released).rowcount
