"""tenants/responses.py on SQLite and PostgreSQL: stored responses saved and updated, read
only by their tenant and only until they expire, deleted, walked back as a conversation,
capped per tenant (oldest first), swept, and failed when a gateway restarted under them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from tenants.db import Database, upgrade
from tenants.models import StoredResponseRow
from tenants.responses import ResponseStore, StoredResponse
from tenants.tenants import create_tenant

T0 = datetime(2026, 12, 15, 12, 0, tzinfo=UTC)
DAY = 86400.0


def response(
    n: int,
    tenant_id: str,
    *,
    previous: str | None = None,
    status: str = "completed",
    background: bool = False,
    created_at: datetime | None = None,
    expires_at: datetime | None = None,
) -> StoredResponse:
    rid = f"resp_{n:032x}"
    created = created_at or T0 + timedelta(seconds=n)
    body: dict[str, Any] = {"id": rid, "object": "response", "status": status, "output": []}
    return StoredResponse(
        id=rid,
        tenant_id=tenant_id,
        key_id="key_a",
        model="demo",
        status=status,
        background=background,
        previous_response_id=previous,
        input_items=[{"id": f"msg_{n}", "type": "message", "role": "user", "content": "ünï"}],
        output=[],
        body=body,
        created_at=created,
        # Far ahead unless told: the store compares with the clock, not with T0.
        expires_at=expires_at or datetime.now(UTC) + timedelta(days=1),
    )


def run(
    database_url: str,
    body: Callable[[ResponseStore, str, str], Awaitable[None]],
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
            await body(ResponseStore(db, ttl=DAY, max_per_tenant=max_per_tenant), a.id, b.id)
        finally:
            await db.close()

    asyncio.run(main())


def test_saved_then_updated_and_read_by_its_tenant_only(database_url: str) -> None:
    async def body(store: ResponseStore, a: str, b: str) -> None:
        first = response(1, a, status="in_progress", background=True)
        await store.save(first)
        got = await store.get(a, first.id)
        assert got == first
        assert got is not None and got.created_at.tzinfo is not None
        assert got.created_at == T0 + timedelta(seconds=1)

        done = response(1, a, status="completed", background=True)
        done.output = [{"id": "msg_out", "type": "message", "content": [{"text": "hi"}]}]
        done.body = done.body | {"status": "completed", "output": done.output}
        done.input_items = [{"ignored": "inputs are not mutable"}]
        await store.save(done)
        got = await store.get(a, first.id)
        assert got is not None
        assert (got.status, got.output, got.body) == ("completed", done.output, done.body)
        assert got.input_items == first.input_items and got.created_at == first.created_at

        assert await store.get(b, first.id) is None  # another tenant's
        assert await store.get(a, "resp_unknown") is None
        assert await store.chain(b, first.id) is None
        assert not await store.delete(b, first.id)
        assert await store.get(a, first.id) is not None

    run(database_url, body)


def test_expired_reads_as_missing_and_delete_removes(database_url: str) -> None:
    async def body(store: ResponseStore, a: str, b: str) -> None:
        past = datetime.now(UTC) - timedelta(seconds=1)
        expired = response(1, a, expires_at=past)
        live = response(2, a)
        await store.save(expired)
        await store.save(live)
        assert await store.get(a, expired.id) is None
        assert await store.chain(a, expired.id) is None
        assert not await store.delete(a, expired.id)

        assert await store.delete(a, live.id)
        assert await store.get(a, live.id) is None
        assert not await store.delete(a, live.id)  # once

    run(database_url, body)


def test_new_expiry_is_ttl_ahead_in_utc(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'unused.db'}")  # never connected to
    store = ResponseStore(db, ttl=DAY, max_per_tenant=1)
    east = datetime(2026, 12, 15, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    assert store.new_expiry(east) == datetime(2026, 12, 16, 12, 0, tzinfo=UTC)
    assert store.new_expiry(east).tzinfo is UTC and store.new_expiry().tzinfo is UTC
    with pytest.raises(ValueError):
        ResponseStore(db, ttl=0, max_per_tenant=1)
    with pytest.raises(ValueError):
        ResponseStore(db, ttl=1, max_per_tenant=0)


def test_a_chain_is_walked_back_oldest_first_and_ends_at_a_missing_turn(
    database_url: str,
) -> None:
    async def body(store: ResponseStore, a: str, b: str) -> None:
        one = response(1, a)
        two = response(2, a, previous=one.id)
        three = response(3, a, previous=two.id)
        for turn in (one, two, three):
            await store.save(turn)
        chain = await store.chain(a, three.id)
        assert chain is not None and [r.id for r in chain] == [one.id, two.id, three.id]
        assert chain[0] == one
        assert [r.id for r in await store.chain(a, two.id) or []] == [one.id, two.id]
        assert [r.id for r in await store.chain(a, three.id, max_turns=2) or []] == [
            two.id,
            three.id,
        ]

        # Another tenant's response of the same id as an ancestor is not followed.
        other = response(4, b, previous=one.id)
        await store.save(other)
        assert [r.id for r in await store.chain(b, other.id) or []] == [other.id]

        assert await store.delete(a, two.id)  # the middle turn: the chain ends after it
        assert [r.id for r in await store.chain(a, three.id) or []] == [three.id]

    run(database_url, body)


def test_the_cap_deletes_the_tenants_oldest(database_url: str) -> None:
    async def body(store: ResponseStore, a: str, b: str) -> None:
        await store.save(response(9, b))
        for n in (1, 2, 3):
            await store.save(response(n, a))
        # One older than every other: the newest others are kept, and it too.
        old = response(4, a, created_at=T0 - timedelta(days=1))
        await store.save(old)
        kept = [n for n in (1, 2, 3, 4) if await store.get(a, response(n, a).id) is not None]
        assert kept == [2, 3, 4]
        # An update inserts nothing: nothing is capped.
        await store.save(response(2, a, status="failed"))
        assert [n for n in (2, 3, 4) if await store.get(a, response(n, a).id)] == [2, 3, 4]
        assert await store.get(b, response(9, b).id) is not None  # other tenants untouched
        await store.save(response(5, a))  # the oldest (4) goes now
        kept = [n for n in (2, 3, 4, 5) if await store.get(a, response(n, a).id) is not None]
        assert kept == [2, 3, 5]

    run(database_url, body, max_per_tenant=3)


def test_sweep_removes_the_expired_only(database_url: str) -> None:
    async def body(store: ResponseStore, a: str, b: str) -> None:
        now = datetime.now(UTC)
        await store.save(response(1, a, expires_at=now - timedelta(seconds=5)))
        await store.save(response(2, b, expires_at=now - timedelta(seconds=1)))
        # In another zone: stored as its UTC instant (SQLite's text would drop the offset).
        west = timezone(timedelta(hours=-5))
        await store.save(response(3, a, expires_at=(now + timedelta(hours=1)).astimezone(west)))
        assert await store.sweep() == 2
        assert await store.sweep() == 0
        assert await store.get(a, response(3, a).id) is not None
        assert not await store.delete(a, response(1, a).id)  # gone, not only hidden
        # As of a later time (the sweep's `now`), the last one has expired too.
        assert await store.sweep(now + timedelta(hours=2)) == 1

    run(database_url, body)


def test_fail_unfinished_fails_only_background_responses_whose_gateway_fell_silent(
    database_url: str,
) -> None:
    async def body(store: ResponseStore, a: str, b: str) -> None:
        queued = response(1, a, status="queued", background=True)
        running = response(2, b, status="in_progress", background=True)
        finished = response(3, a, status="completed", background=True)
        foreground = response(4, a, status="in_progress")
        beating = response(5, b, status="in_progress", background=True)  # another gateway's
        for r in (queued, running, finished, foreground, beating):
            await store.save(r)
        # Nothing is silent yet: a gateway starting beside running ones fails none of them.
        assert await store.fail_unfinished(silent_for=60) == 0
        # An hour without a beat, as if their gateways had died then (set, not slept for: a
        # beat a moment ago must read as fresh however slow this machine is), and one gateway
        # beats for its own again.
        async with store.db.session() as session, session.begin():
            hour_ago = datetime.now(UTC) - timedelta(hours=1)
            await session.execute(update(StoredResponseRow).values(heartbeat_at=hour_ago))
        await store.beat([beating.id])
        assert await store.fail_unfinished(silent_for=60) == 2
        for tenant, left in ((a, queued), (b, running)):
            got = await store.get(tenant, left.id)
            assert got is not None and got.status == "failed"
            assert got.body["status"] == "failed" and got.body["id"] == left.id
            assert got.body["error"]["code"] == "server_restarted"
        assert (await store.get(b, beating.id)) == beating
        assert (await store.get(a, finished.id)) == finished
        assert (await store.get(a, foreground.id)) == foreground
        assert await store.fail_unfinished(silent_for=60) == 0

    run(database_url, body)
