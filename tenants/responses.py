"""Stored responses of the Responses API (`/v1/responses`), per tenant, in the database.

A response is stored when its request says `store` (OpenAI's default): it can then be
retrieved, continued from with `previous_response_id`, its input items listed, and, while it
runs in the background, cancelled. Every read is scoped to a tenant: another tenant's id, or
one past its `expires_at`, reads as missing. An expired row stays in the table until the next
`sweep`; a tenant holding more than `max_per_tenant` loses its oldest at the next insert.

Times are stored in UTC: SQLite keeps a date-time as text without its offset, so a value in
another zone would be stored (and compared) as if it were UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, literal_column, select, update
from sqlalchemy.orm import aliased

from tenants.db import Database
from tenants.models import StoredResponseRow, utcnow

UNFINISHED = ("queued", "in_progress")
# A gateway running background responses says so this often (`beat`); one silent for
# SILENT_AFTER seconds has stopped, and what it ran is failed (`fail_unfinished`).
BEAT_INTERVAL = 30.0
SILENT_AFTER = 4 * BEAT_INTERVAL
RESTARTED_ERROR = {
    "code": "server_restarted",
    "message": "The gateway running this background response stopped; create it again.",
}


@dataclass(slots=True)
class StoredResponse:
    id: str
    tenant_id: str
    key_id: str | None
    model: str
    status: str  # tenants.models.RESPONSE_STATUSES
    background: bool
    previous_response_id: str | None
    input_items: list[dict[str, Any]]  # this turn's input, as items with ids
    output: list[dict[str, Any]]  # the output items
    body: dict[str, Any]  # the whole response object as last returned to the client
    created_at: datetime  # timezone-aware UTC
    expires_at: datetime


def _utc(moment: datetime) -> datetime:
    """Aware and in UTC (a naive value is taken as UTC, as tenants.models.UTCDateTime does)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _stored(row: StoredResponseRow) -> StoredResponse:
    return StoredResponse(
        id=row.id,
        tenant_id=row.tenant_id,
        key_id=row.key_id,
        model=row.model,
        status=row.status,
        background=row.background,
        previous_response_id=row.previous_response_id,
        input_items=row.input_items,
        output=row.output,
        body=row.body,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


class ResponseStore:
    """The `responses` table, one session per call (none is shared with the caller)."""

    def __init__(self, db: Database, *, ttl: float, max_per_tenant: int) -> None:
        """`ttl`: seconds a response is kept after it is created."""
        if not ttl > 0:
            raise ValueError("stored responses' ttl: seconds > 0")
        if max_per_tenant < 1:
            raise ValueError("stored responses per tenant: at least 1")
        self.db = db
        self.ttl = timedelta(seconds=ttl)
        self.max_per_tenant = max_per_tenant

    def new_expiry(self, now: datetime | None = None) -> datetime:
        return _utc(now or utcnow()) + self.ttl

    async def save(self, response: StoredResponse) -> None:
        """Insert, or update every mutable field (status, output, body) of an existing id of
        the same tenant. After an insert, the tenant's stored responses beyond
        max_per_tenant are deleted, oldest created_at first (never the one just saved).
        Raises sqlalchemy's IntegrityError for an id another tenant holds."""
        row = StoredResponseRow
        async with self.db.session() as session, session.begin():
            updated = await session.execute(
                update(row)
                .where(row.id == response.id, row.tenant_id == response.tenant_id)
                .values(
                    status=response.status,
                    output=response.output,
                    body=response.body,
                    heartbeat_at=utcnow(),
                )
                .execution_options(synchronize_session=False)
            )
            if cast(CursorResult[Any], updated).rowcount:
                return
            session.add(
                StoredResponseRow(
                    id=response.id,
                    tenant_id=response.tenant_id,
                    key_id=response.key_id,
                    model=response.model,
                    status=response.status,
                    background=response.background,
                    previous_response_id=response.previous_response_id,
                    input_items=response.input_items,
                    output=response.output,
                    body=response.body,
                    created_at=_utc(response.created_at),
                    expires_at=_utc(response.expires_at),
                    heartbeat_at=utcnow(),
                )
            )
            await session.flush()
            # Keep the one just saved and the newest max_per_tenant - 1 others (ties in
            # created_at broken by id, so that every replica deletes the same ones).
            beyond = (
                select(row.id)
                .where(row.tenant_id == response.tenant_id, row.id != response.id)
                .order_by(row.created_at.desc(), row.id.desc())
                .offset(self.max_per_tenant - 1)
            )
            await session.execute(
                delete(row).where(row.id.in_(beyond)).execution_options(synchronize_session=False)
            )

    async def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        """None for an unknown id, another tenant's, or one past expires_at."""
        row = StoredResponseRow
        async with self.db.session() as session:
            found = await session.scalar(
                select(row).where(
                    row.id == response_id, row.tenant_id == tenant_id, row.expires_at > utcnow()
                )
            )
        return None if found is None else _stored(found)

    async def delete(self, tenant_id: str, response_id: str) -> bool:
        """False where get would answer None (an expired row is left to the sweep)."""
        row = StoredResponseRow
        async with self.db.session() as session, session.begin():
            deleted = await session.execute(
                delete(row)
                .where(row.id == response_id, row.tenant_id == tenant_id, row.expires_at > utcnow())
                .execution_options(synchronize_session=False)
            )
        return bool(cast(CursorResult[Any], deleted).rowcount)

    async def chain(
        self, tenant_id: str, response_id: str, max_turns: int = 1000
    ) -> list[StoredResponse] | None:
        """The conversation ending at response_id, oldest first, following
        previous_response_id back while the previous one exists for this tenant (a missing
        or expired ancestor ends the chain there), at most max_turns responses (the newest);
        None when response_id itself is not found (same rules as get)."""
        if max_turns < 1:
            raise ValueError("max_turns: at least 1")
        row, now = StoredResponseRow, utcnow()
        # One round trip however long the chain: a recursive query walks it back, `depth`
        # counting turns from the newest (a bound, too, should ids ever form a cycle).
        walk = (
            select(row.id, row.previous_response_id, literal_column("1").label("depth"))
            .where(row.id == response_id, row.tenant_id == tenant_id, row.expires_at > now)
            .cte("chain", recursive=True)
        )
        earlier = aliased(StoredResponseRow)
        walk = walk.union_all(
            select(
                earlier.id,
                earlier.previous_response_id,
                (walk.c.depth + literal_column("1")).label("depth"),
            ).where(
                earlier.id == walk.c.previous_response_id,
                earlier.tenant_id == tenant_id,
                earlier.expires_at > now,
                walk.c.depth < max_turns,
            )
        )
        query = select(row).join(walk, walk.c.id == row.id).order_by(walk.c.depth.desc())
        async with self.db.session() as session:
            rows = list(await session.scalars(query))
        return [_stored(r) for r in rows] or None

    async def sweep(self, now: datetime | None = None) -> int:
        """Delete every expired response (all tenants); how many."""
        row = StoredResponseRow
        async with self.db.session() as session, session.begin():
            deleted = await session.execute(
                delete(row)
                .where(row.expires_at <= _utc(now or utcnow()))
                .execution_options(synchronize_session=False)
            )
        return cast(CursorResult[Any], deleted).rowcount

    async def beat(self, response_ids: list[str]) -> None:
        """The gateway running these background responses still runs them."""
        if not response_ids:
            return
        row = StoredResponseRow
        async with self.db.session() as session, session.begin():
            await session.execute(
                update(row)
                .where(row.id.in_(response_ids))
                .values(heartbeat_at=utcnow())
                .execution_options(synchronize_session=False)
            )

    async def fail_unfinished(self, silent_for: float) -> int:
        """Background responses left `queued`/`in_progress` whose gateway has not beaten for
        `silent_for` seconds (it stopped, or died) become `failed` (their body's status and an
        `error` set too); how many. Safe where gateways share the database: a running one
        beats more often than that."""
        row = StoredResponseRow
        stale = utcnow() - timedelta(seconds=silent_for)
        async with self.db.session() as session, session.begin():
            left = await session.scalars(
                select(row).where(
                    row.background, row.status.in_(UNFINISHED), row.heartbeat_at < stale
                )
            )
            count = 0
            for found in left:
                found.status = "failed"
                # A new dict, not the loaded one changed in place: a JSON column's changes are
                # seen by assignment only.
                found.body = found.body | {"status": "failed", "error": dict(RESTARTED_ERROR)}
                count += 1
        return count
