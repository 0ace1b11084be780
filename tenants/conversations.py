"""Conversations of the Conversations API (`/v1/conversations`), per tenant, in the database.

A conversation is its metadata and its items in order (messages, function calls and their
outputs, in the Responses API's shape, each with an id unique within the conversation). Items
are added through the API or by a response that names the conversation (its input and output
items, appended together once it has finished). Every read is scoped to a tenant: another
tenant's id, or one past its `expires_at`, reads as missing.

A conversation is kept `ttl` seconds after it was last written (created, items added or
deleted, metadata updated): every write moves `expires_at` on, and an expired one takes no
more writes, so a sweep never races a write that would revive it. A tenant holding more than
`max_per_tenant` loses its least recently written at the next create; a conversation holding
MAX_ITEMS items takes no more (a response reads the whole conversation each turn).

Writes to one conversation are serialised by its row: each write updates it first (a row lock
on PostgreSQL; SQLite has one writer), which is also how positions are handed out.

Times are stored in UTC (see tenants/responses.py). SQLite enforces no foreign keys unless
asked to, so items are deleted by hand wherever their conversation goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from sqlalchemy import CursorResult, delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.db import Database
from tenants.models import ConversationItemRow, ConversationRow, utcnow

MAX_ITEMS = 10_000


class ConversationFull(Exception):
    """The conversation holds MAX_ITEMS items already."""


class DuplicateItem(Exception):
    """An item id the conversation (or the same batch) holds already."""

    def __init__(self, item_id: str) -> None:
        super().__init__(f"an item with id {item_id!r} is in the conversation already")
        self.item_id = item_id


class ItemNotFound(LookupError):
    """No such item in a conversation that exists."""


@dataclass(slots=True)
class StoredConversation:
    id: str
    tenant_id: str
    key_id: str | None
    metadata: dict[str, str]
    created_at: datetime  # timezone-aware UTC
    expires_at: datetime


@dataclass(slots=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


def _utc(moment: datetime) -> datetime:
    """Aware and in UTC (a naive value is taken as UTC, as tenants.models.UTCDateTime does)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _stored(row: ConversationRow) -> StoredConversation:
    return StoredConversation(
        id=row.id,
        tenant_id=row.tenant_id,
        key_id=row.key_id,
        metadata=dict(row.meta),
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


def _live(tenant_id: str, conversation_id: str, now: datetime) -> list[Any]:
    row = ConversationRow
    return [row.id == conversation_id, row.tenant_id == tenant_id, row.expires_at > now]


def _item_ids(items: list[dict[str, Any]]) -> list[str]:
    """Each item's id; raises DuplicateItem for an id given twice."""
    ids: list[str] = []
    for item in items:
        item_id = str(item["id"])
        if item_id in ids:
            raise DuplicateItem(item_id)
        ids.append(item_id)
    return ids


class ConversationStore:
    """The `conversations` and `conversation_items` tables, one session per call."""

    def __init__(self, db: Database, *, ttl: float, max_per_tenant: int) -> None:
        """`ttl`: seconds a conversation is kept after it was last written."""
        if not ttl > 0:
            raise ValueError("conversations' ttl: seconds > 0")
        if max_per_tenant < 1:
            raise ValueError("conversations per tenant: at least 1")
        self.db = db
        self.ttl = timedelta(seconds=ttl)
        self.max_per_tenant = max_per_tenant

    def new_expiry(self, now: datetime | None = None) -> datetime:
        return _utc(now or utcnow()) + self.ttl

    # -- conversations --------------------------------------------------------------------

    async def create(self, conversation: StoredConversation, items: list[dict[str, Any]]) -> None:
        """Insert the conversation and its first items (in their order) in one transaction.
        After it, the tenant's conversations beyond max_per_tenant are deleted, least recently
        written first (never the one just made). Raises DuplicateItem for an id given twice,
        sqlalchemy's IntegrityError for a conversation id in use."""
        _item_ids(items)  # DuplicateItem before anything is written
        now = utcnow()
        async with self.db.session() as session, session.begin():
            session.add(
                ConversationRow(
                    id=conversation.id,
                    tenant_id=conversation.tenant_id,
                    key_id=conversation.key_id,
                    meta=conversation.metadata,
                    next_position=len(items),
                    created_at=_utc(conversation.created_at),
                    expires_at=_utc(conversation.expires_at),
                )
            )
            await session.flush()
            await self._insert_items(session, conversation.id, 0, items, now)
            row = ConversationRow
            # Ties in expires_at broken by id, so that every replica deletes the same ones.
            beyond = list(
                await session.scalars(
                    select(row.id)
                    .where(row.tenant_id == conversation.tenant_id, row.id != conversation.id)
                    .order_by(row.expires_at.desc(), row.id.desc())
                    .offset(self.max_per_tenant - 1)
                )
            )
            await _delete_conversations(session, beyond)

    async def get(self, tenant_id: str, conversation_id: str) -> StoredConversation | None:
        """None for an unknown id, another tenant's, or one past expires_at."""
        async with self.db.session() as session:
            found = await session.scalar(
                select(ConversationRow).where(*_live(tenant_id, conversation_id, utcnow()))
            )
        return None if found is None else _stored(found)

    async def update_metadata(
        self, tenant_id: str, conversation_id: str, metadata: dict[str, str]
    ) -> StoredConversation | None:
        """Replace the metadata; None where get would answer None."""
        async with self.db.session() as session, session.begin():
            found = await self._touch(session, tenant_id, conversation_id, 0, meta=metadata)
        return None if found is None else _stored(found)

    async def delete(self, tenant_id: str, conversation_id: str) -> bool:
        """The conversation and its items; False where get would answer None (an expired one
        is left to the sweep)."""
        row = ConversationRow
        async with self.db.session() as session, session.begin():
            deleted = await session.execute(
                delete(row)
                .where(*_live(tenant_id, conversation_id, utcnow()))
                .execution_options(synchronize_session=False)
            )
            if not cast(CursorResult[Any], deleted).rowcount:
                return False
            await _delete_items(session, [conversation_id])
        return True

    async def sweep(self, now: datetime | None = None) -> int:
        """Delete every expired conversation and its items (all tenants); how many. An expired
        conversation takes no writes, so none comes back between the two deletes."""
        moment = _utc(now or utcnow())
        row = ConversationRow
        expired = select(row.id).where(row.expires_at <= moment)
        async with self.db.session() as session, session.begin():
            await session.execute(
                delete(ConversationItemRow)
                .where(ConversationItemRow.conversation_id.in_(expired))
                .execution_options(synchronize_session=False)
            )
            deleted = await session.execute(
                delete(row)
                .where(row.expires_at <= moment)
                .execution_options(synchronize_session=False)
            )
        return cast(CursorResult[Any], deleted).rowcount

    # -- items ------------------------------------------------------------------------------

    async def add_items(
        self, tenant_id: str, conversation_id: str, items: list[dict[str, Any]]
    ) -> bool:
        """Append the items, in their order, in one transaction; False where get would answer
        None. Raises ConversationFull when the conversation holds MAX_ITEMS already (a batch
        that starts below it is taken whole), DuplicateItem for an id it holds already or
        given twice."""
        ids = _item_ids(items)
        now = utcnow()
        async with self.db.session() as session, session.begin():
            found = await self._touch(session, tenant_id, conversation_id, len(items))
            if found is None:
                return False
            item = ConversationItemRow
            held = await session.scalar(
                select(func.count()).where(item.conversation_id == conversation_id)
            )
            if (held or 0) >= MAX_ITEMS:
                raise ConversationFull(conversation_id)
            taken = await session.scalar(
                select(item.item_id)
                .where(item.conversation_id == conversation_id, item.item_id.in_(ids))
                .limit(1)
            )
            if taken is not None:
                raise DuplicateItem(taken)
            start = found.next_position - len(items)
            await self._insert_items(session, conversation_id, start, items, now)
        return True

    async def items(self, tenant_id: str, conversation_id: str) -> list[dict[str, Any]] | None:
        """Every item, oldest first; None where get would answer None."""
        item = ConversationItemRow
        async with self.db.session() as session:
            if await self._find(session, tenant_id, conversation_id) is None:
                return None
            rows = await session.scalars(
                select(item.item)
                .where(item.conversation_id == conversation_id)
                .order_by(item.position)
            )
            return list(rows)

    async def list_items(
        self,
        tenant_id: str,
        conversation_id: str,
        order: Literal["asc", "desc"],
        limit: int,
        after: str | None,
    ) -> ItemPage | None:
        """A page of at most `limit` items in `order` of position, after the item `after`
        (an id not in the conversation: an empty page); None where get would answer None."""
        item = ConversationItemRow
        async with self.db.session() as session:
            if await self._find(session, tenant_id, conversation_id) is None:
                return None
            query = select(item.item).where(item.conversation_id == conversation_id)
            if after is not None:
                position = await session.scalar(
                    select(item.position).where(
                        item.conversation_id == conversation_id, item.item_id == after
                    )
                )
                if position is None:
                    return ItemPage([], False)
                query = query.where(
                    item.position > position if order == "asc" else item.position < position
                )
            ordering = item.position.asc() if order == "asc" else item.position.desc()
            rows = list(await session.scalars(query.order_by(ordering).limit(limit + 1)))
        return ItemPage(rows[:limit], len(rows) > limit)

    async def get_item(
        self, tenant_id: str, conversation_id: str, item_id: str
    ) -> dict[str, Any] | None:
        """None where get would answer None; raises ItemNotFound for an item it lacks."""
        item = ConversationItemRow
        async with self.db.session() as session:
            if await self._find(session, tenant_id, conversation_id) is None:
                return None
            found: dict[str, Any] | None = await session.scalar(
                select(item.item).where(
                    item.conversation_id == conversation_id, item.item_id == item_id
                )
            )
        if found is None:
            raise ItemNotFound(item_id)
        return found

    async def delete_item(
        self, tenant_id: str, conversation_id: str, item_id: str
    ) -> StoredConversation | None:
        """Delete one item; the conversation as it stands after. None where get would answer
        None; raises ItemNotFound for an item it lacks (and then nothing changes)."""
        item = ConversationItemRow
        async with self.db.session() as session, session.begin():
            found = await self._touch(session, tenant_id, conversation_id, 0)
            if found is None:
                return None
            deleted = await session.execute(
                delete(item)
                .where(item.conversation_id == conversation_id, item.item_id == item_id)
                .execution_options(synchronize_session=False)
            )
            if not cast(CursorResult[Any], deleted).rowcount:
                raise ItemNotFound(item_id)  # rolls back the expiry moved on by _touch
            return _stored(found)

    # -- helpers --------------------------------------------------------------------------

    async def _find(
        self, session: AsyncSession, tenant_id: str, conversation_id: str
    ) -> ConversationRow | None:
        return await session.scalar(
            select(ConversationRow).where(*_live(tenant_id, conversation_id, utcnow()))
        )

    async def _touch(
        self,
        session: AsyncSession,
        tenant_id: str,
        conversation_id: str,
        positions: int,
        **values: Any,
    ) -> ConversationRow | None:
        """The first statement of every write to a live conversation: its expiry moved on,
        `positions` more handed out (the row after the update: the new items take the
        positions just below `next_position`), `values` set. Locks the row until the
        transaction ends. None when the conversation is not live for this tenant."""
        now = utcnow()
        row = ConversationRow
        result = await session.scalars(
            update(row)
            .where(*_live(tenant_id, conversation_id, now))
            .values(
                next_position=row.next_position + positions,
                expires_at=self.new_expiry(now),
                **values,
            )
            .returning(row)
            .execution_options(synchronize_session=False)
        )
        return result.one_or_none()

    async def _insert_items(
        self,
        session: AsyncSession,
        conversation_id: str,
        start: int,
        items: list[dict[str, Any]],
        now: datetime,
    ) -> None:
        if not items:
            return
        await session.execute(
            insert(ConversationItemRow),
            [
                {
                    "conversation_id": conversation_id,
                    "position": start + i,
                    "item_id": str(item["id"]),
                    "item": item,
                    "created_at": now,
                }
                for i, item in enumerate(items)
            ],
        )


async def _delete_items(session: AsyncSession, conversation_ids: list[str]) -> None:
    if conversation_ids:
        await session.execute(
            delete(ConversationItemRow)
            .where(ConversationItemRow.conversation_id.in_(conversation_ids))
            .execution_options(synchronize_session=False)
        )


async def _delete_conversations(session: AsyncSession, conversation_ids: list[str]) -> None:
    """The conversations and their items (by hand: SQLite enforces no foreign keys)."""
    if conversation_ids:
        await _delete_items(session, conversation_ids)
        await session.execute(
            delete(ConversationRow)
            .where(ConversationRow.id.in_(conversation_ids))
            .execution_options(synchronize_session=False)
        )
