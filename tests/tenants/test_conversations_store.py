"""tenants/conversations.py on SQLite and PostgreSQL: conversations made with their first
items, read only by their tenant and only until they expire (every write moving the expiry
on), metadata replaced, items appended in order and paged both ways, duplicates and a full
conversation refused, items and conversations deleted, the per-tenant cap (least recently
written first), the sweep, and the tenant's deletion taking its conversations and their items."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

import tenants.conversations
from tenants.conversations import (
    ConversationFull,
    ConversationStore,
    DuplicateItem,
    ItemNotFound,
    StoredConversation,
)
from tenants.db import Database, upgrade
from tenants.models import ConversationItemRow, ConversationRow
from tenants.tenants import create_tenant, delete_tenant, get_tenant

DAY = 86400.0


def conversation(
    n: int, tenant_id: str, *, expires_at: datetime | None = None, **metadata: str
) -> StoredConversation:
    return StoredConversation(
        id=f"conv_{n:032x}",
        tenant_id=tenant_id,
        key_id="key_a",
        metadata=metadata,
        created_at=datetime.now(UTC),
        expires_at=expires_at or datetime.now(UTC) + timedelta(days=1),
    )


def item(name: str, text: str = "ünï") -> dict[str, Any]:
    return {
        "type": "message",
        "id": name,
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }


def run(
    database_url: str,
    body: Callable[[ConversationStore, str, str], Awaitable[None]],
    *,
    max_per_tenant: int = 100,
) -> None:
    """Migrate, create two tenants, and run `body(store, tenant_a, tenant_b)`."""
    upgrade(database_url)

    async def main() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                a = await create_tenant(session, name="acme")
                b = await create_tenant(session, name="bravo")
            store = ConversationStore(db, ttl=DAY, max_per_tenant=max_per_tenant)
            await body(store, a.id, b.id)
        finally:
            await db.close()

    asyncio.run(main())


def ids(items: list[dict[str, Any]]) -> list[str]:
    return [i["id"] for i in items]


def test_made_read_updated_and_deleted_by_its_tenant_only(database_url: str) -> None:
    async def body(store: ConversationStore, a: str, b: str) -> None:
        first = conversation(1, a, topic="rivers")
        await store.create(first, [item("msg_1"), item("msg_2")])
        got = await store.get(a, first.id)
        assert got is not None and got.metadata == {"topic": "rivers"}
        assert got.created_at.tzinfo is not None and got.id == first.id
        assert ids(await store.items(a, first.id) or []) == ["msg_1", "msg_2"]

        updated = await store.update_metadata(a, first.id, {"topic": "lakes"})
        assert updated is not None and updated.metadata == {"topic": "lakes"}
        assert updated.expires_at >= got.expires_at  # a write moves the expiry on
        assert (await store.get(a, first.id)) == updated

        # Another tenant's id is an unknown one, for every call.
        assert await store.get(b, first.id) is None
        assert await store.update_metadata(b, first.id, {}) is None
        assert await store.items(b, first.id) is None
        assert await store.list_items(b, first.id, "asc", 10, None) is None
        assert await store.get_item(b, first.id, "msg_1") is None
        assert await store.delete_item(b, first.id, "msg_1") is None
        assert not await store.add_items(b, first.id, [item("msg_3")])
        assert not await store.delete(b, first.id)
        assert await store.get(a, "conv_unknown") is None
        assert ids(await store.items(a, first.id) or []) == ["msg_1", "msg_2"]

        assert await store.delete(a, first.id)
        assert await store.get(a, first.id) is None
        assert not await store.delete(a, first.id)  # once
        async with store.db.session() as session:  # its items went with it
            assert await session.scalar(select(func.count(ConversationItemRow.item_id))) == 0

    run(database_url, body)


def test_items_append_in_order_and_page_both_ways(database_url: str) -> None:
    async def body(store: ConversationStore, a: str, b: str) -> None:
        conv = conversation(1, a)
        await store.create(conv, [item("i0")])
        assert await store.add_items(a, conv.id, [item("i1"), item("i2")])
        assert await store.add_items(a, conv.id, [item("i3")])
        assert await store.add_items(a, conv.id, [])  # nothing to add, and no error
        assert ids(await store.items(a, conv.id) or []) == ["i0", "i1", "i2", "i3"]

        page = await store.list_items(a, conv.id, "desc", 2, None)
        assert page is not None and ids(page.items) == ["i3", "i2"] and page.has_more
        page = await store.list_items(a, conv.id, "desc", 2, "i2")
        assert page is not None and ids(page.items) == ["i1", "i0"] and not page.has_more
        page = await store.list_items(a, conv.id, "asc", 3, "i0")
        assert page is not None and ids(page.items) == ["i1", "i2", "i3"] and not page.has_more
        page = await store.list_items(a, conv.id, "asc", 10, "not-there")
        assert page is not None and page.items == [] and not page.has_more

        assert (await store.get_item(a, conv.id, "i2")) == item("i2")
        with pytest.raises(ItemNotFound):
            await store.get_item(a, conv.id, "nope")
        after = await store.delete_item(a, conv.id, "i2")
        assert after is not None and after.id == conv.id
        with pytest.raises(ItemNotFound):
            await store.delete_item(a, conv.id, "i2")
        # Deleted items leave a gap; new ones still come last.
        assert await store.add_items(a, conv.id, [item("i4")])
        assert ids(await store.items(a, conv.id) or []) == ["i0", "i1", "i3", "i4"]

    run(database_url, body)


def test_duplicates_and_a_full_conversation_are_refused_whole(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(store: ConversationStore, a: str, b: str) -> None:
        conv = conversation(1, a)
        with pytest.raises(DuplicateItem):
            await store.create(conv, [item("x"), item("x")])
        assert await store.get(a, conv.id) is None
        await store.create(conv, [item("x")])
        with pytest.raises(DuplicateItem) as caught:
            await store.add_items(a, conv.id, [item("y"), item("x")])
        assert caught.value.item_id == "x"
        with pytest.raises(DuplicateItem):
            await store.add_items(a, conv.id, [item("z"), item("z")])
        assert ids(await store.items(a, conv.id) or []) == ["x"]  # nothing of either

        # The same id in another conversation is no duplicate.
        other = conversation(2, b)
        await store.create(other, [item("x")])

        monkeypatch.setattr(tenants.conversations, "MAX_ITEMS", 3)
        assert await store.add_items(a, conv.id, [item("y"), item("z")])  # 3: full now
        with pytest.raises(ConversationFull):
            await store.add_items(a, conv.id, [item("w")])
        assert ids(await store.items(a, conv.id) or []) == ["x", "y", "z"]

    run(database_url, body)


def test_expired_reads_as_missing_and_takes_no_writes(database_url: str) -> None:
    async def body(store: ConversationStore, a: str, b: str) -> None:
        past = datetime.now(UTC) - timedelta(seconds=1)
        expired = conversation(1, a, expires_at=past)
        await store.create(expired, [item("m")])
        assert await store.get(a, expired.id) is None
        assert await store.items(a, expired.id) is None
        assert not await store.add_items(a, expired.id, [item("n")])
        assert await store.update_metadata(a, expired.id, {"k": "v"}) is None
        assert not await store.delete(a, expired.id)
        assert await store.sweep() == 1
        async with store.db.session() as session:
            assert await session.scalar(select(func.count(ConversationItemRow.item_id))) == 0

    run(database_url, body)


def test_the_cap_deletes_the_least_recently_written(database_url: str) -> None:
    async def body(store: ConversationStore, a: str, b: str) -> None:
        await store.create(conversation(9, b), [])
        for n in (1, 2, 3):
            await store.create(conversation(n, a), [item(f"m{n}")])
            await asyncio.sleep(0.01)  # distinct expiries
        assert await store.add_items(a, conversation(1, a).id, [item("again")])  # 1 is fresh
        await store.create(conversation(4, a), [])
        kept = [n for n in (1, 2, 3, 4) if await store.get(a, conversation(n, a).id)]
        assert kept == [1, 3, 4]
        assert await store.get(b, conversation(9, b).id) is not None  # others untouched
        async with store.db.session() as session:  # the capped one's items went too
            held = await session.scalars(select(ConversationItemRow.item_id))
            assert sorted(held) == ["again", "m1", "m3"]

    run(database_url, body, max_per_tenant=3)


def test_new_expiry_is_ttl_ahead_in_utc(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'unused.db'}")  # never connected to
    store = ConversationStore(db, ttl=DAY, max_per_tenant=1)
    moment = datetime(2026, 12, 15, 12, 0, tzinfo=UTC)
    assert store.new_expiry(moment) == moment + timedelta(days=1)
    with pytest.raises(ValueError):
        ConversationStore(db, ttl=0, max_per_tenant=1)
    with pytest.raises(ValueError):
        ConversationStore(db, ttl=1, max_per_tenant=0)


def test_deleting_the_tenant_deletes_its_conversations_and_items(database_url: str) -> None:
    async def body(store: ConversationStore, a: str, b: str) -> None:
        await store.create(conversation(1, a), [item("m1"), item("m2")])
        await store.create(conversation(2, b), [item("m3")])
        async with store.db.session() as session, session.begin():
            tenant = await get_tenant(session, tenant_id=a)
            assert tenant is not None
            await delete_tenant(session, tenant=tenant)
        async with store.db.session() as session:
            assert list(await session.scalars(select(ConversationRow.tenant_id))) == [b]
            assert list(await session.scalars(select(ConversationItemRow.item_id))) == ["m3"]

    run(database_url, body)
