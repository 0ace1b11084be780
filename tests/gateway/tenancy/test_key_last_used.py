"""A key's `last_used_at` (gateway/tenancy/auth.py): written off the request path when a key is
used, then at most once a minute per key, also with several gateway replicas sharing the database,
and only ever forward; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from sqlalchemy import update

from gateway.tenancy.auth import LAST_USED_INTERVAL, TenantAuth
from tenants.db import Database, upgrade
from tenants.keys import create_key, list_keys, touch_keys
from tenants.models import ApiKey
from tenants.tenants import create_tenant

SECRET = b"a-test-secret-that-is-long-enough-for-loragate-0123456789"


def test_last_used_is_written_once_a_minute_and_only_forward(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                tenant = await create_tenant(session, name="acme")
                row, key = await create_key(session, tenant_id=tenant.id)
            key_id, tenant_id = row.id, tenant.id

            async def last_used() -> datetime | None:
                async with db.session() as session:
                    (listed,) = await list_keys(session, tenant_id=tenant_id)
                    return listed.last_used_at

            async def use(auth: TenantAuth, times: int = 1) -> None:
                for _ in range(times):
                    assert (await auth.authenticate(f"Bearer {key}")).key_id == key_id
                await auth.drain()

            # ttl 0: every request reads the key's row, as a request after the cache's ttl does.
            gateway = TenantAuth(db, SECRET, ttl=0)
            assert await last_used() is None
            await use(gateway)
            first = await last_used()
            assert first is not None
            await use(gateway, 5)  # within the minute: no more writes
            assert await last_used() == first

            # Another replica sees the row's recent value: it does not write either.
            other = TenantAuth(db, SECRET, ttl=0)
            await use(other, 3)
            assert await last_used() == first

            # A minute on (the row set back, as the clock would move on): the next use writes.
            async with db.session() as session, session.begin():
                stale = first - LAST_USED_INTERVAL - timedelta(seconds=1)
                await session.execute(
                    update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=stale)
                )
            await use(other)
            second = await last_used()
            assert second is not None and second > first

            # A replica's late write of an older time leaves the newer one.
            async with db.session() as session, session.begin():
                await touch_keys(session, key_ids=[key_id], when=first)
            assert await last_used() == second
        finally:
            await db.close()

    asyncio.run(run())
