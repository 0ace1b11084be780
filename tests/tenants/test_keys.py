"""API keys in the database: only a prefix and a hash are stored; lookups find the key, and
nothing else, whatever shares its prefix."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from tenants.db import Database, upgrade
from tenants.keys import KEY_PREFIX, PREFIX_LEN, create_key, find_key, hash_key, revoke_key
from tenants.models import ApiKey
from tenants.tenants import create_tenant, delete_tenant


def test_keys_are_stored_as_prefix_and_hash_and_found_exactly(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                tenant = await create_tenant(session, name="acme")
                row, key = await create_key(
                    session, tenant_id=tenant.id, expires_at=datetime.now(UTC) + timedelta(days=1)
                )
            assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 43
            async with db.session() as session:
                stored = (await session.scalars(select(ApiKey))).one()
                assert stored.prefix == key[:PREFIX_LEN] and stored.key_hash == hash_key(key)
                assert key not in {stored.prefix, stored.key_hash, stored.name}
                found = await find_key(session, key)
                assert found is not None and found[1].id == tenant.id
                assert stored.expires_at is not None and stored.expires_at.tzinfo is not None
                # Same prefix, another secret; and not a key at all.
                assert await find_key(session, key[:PREFIX_LEN] + "x" * 43) is None
                assert await find_key(session, "sk-" + key[3:]) is None
                assert await find_key(session, key + "'; DROP TABLE api_keys; --") is None
            async with db.session() as session, session.begin():
                revoked = await revoke_key(session, key_id=row.id)
                assert revoked is not None and revoked.revoked_at is not None
            async with db.session() as session:
                found = await find_key(session, key)  # found, and the caller sees it revoked
                assert found is not None and found[0].revoked_at is not None
            async with db.session() as session, session.begin():
                await delete_tenant(session, tenant=found[1])
            async with db.session() as session:
                assert await find_key(session, key) is None
                assert (await session.scalars(select(ApiKey))).all() == []
        finally:
            await db.close()

    asyncio.run(run())
