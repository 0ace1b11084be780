"""tenants/tenants.py alone, on SQLite and PostgreSQL: names checked and unique, updates that
keep them so, and a deletion that takes the tenant's keys and adapters with it (and returns the
adapters' hashes, whose files may now be unreferenced) but none of another tenant's."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from tenants.db import Database, upgrade
from tenants.keys import create_key
from tenants.models import Adapter, ApiKey
from tenants.tenants import (
    TenantExists,
    count_tenants,
    create_tenant,
    delete_tenant,
    get_tenant,
    get_tenant_by_name,
    list_tenants,
    update_tenant,
)


def _adapter(owner: str, name: str, sha: str) -> Adapter:
    return Adapter(
        owner_id=owner,
        scope=owner,
        name=name,
        base_model="demo",
        rank=8,
        alpha=16.0,
        target_modules=["q_proj"],
        sha256=sha,
        size_bytes=1,
        storage_path=f"/store/{sha}",
    )


def test_a_tenants_life(database_url: str) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                acme = await create_tenant(session, name="acme", rpm_limit=60)
                other = await create_tenant(session, name="other")
                await create_key(session, tenant_id=acme.id)
                await create_key(session, tenant_id=other.id)
                session.add_all(
                    [_adapter(acme.id, "a1", "1" * 64), _adapter(acme.id, "a2", "2" * 64)]
                )
                session.add(_adapter(other.id, "b1", "3" * 64))
            async with db.session() as session:
                assert await count_tenants(session) == 2
                assert [t.name for t in await list_tenants(session)] == ["acme", "other"]
                found = await get_tenant_by_name(session, name="acme")
                assert found is not None and found.id == acme.id and found.rpm_limit == 60
                assert await get_tenant(session, tenant_id="ten_nobody") is None
            with pytest.raises(TenantExists):
                async with db.session() as session, session.begin():
                    await create_tenant(session, name="acme")
            with pytest.raises(ValueError):
                async with db.session() as session, session.begin():
                    await create_tenant(session, name="not a name!")
            with pytest.raises(TenantExists):
                async with db.session() as session, session.begin():
                    tenant = await get_tenant(session, tenant_id=other.id)
                    assert tenant is not None
                    await update_tenant(session, tenant=tenant, name="acme")
            async with db.session() as session, session.begin():
                tenant = await get_tenant(session, tenant_id=acme.id)
                assert tenant is not None
                await update_tenant(session, tenant=tenant, name="acme-2", status="suspended")
                shas = await delete_tenant(session, tenant=tenant)
            assert sorted(shas) == ["1" * 64, "2" * 64]
            async with db.session() as session:
                assert [t.name for t in await list_tenants(session)] == ["other"]
                keys = (await session.scalars(select(ApiKey))).all()
                adapters = (await session.scalars(select(Adapter))).all()
                assert [k.tenant_id for k in keys] == [other.id]
                assert [a.name for a in adapters] == ["b1"]
        finally:
            await db.close()

    asyncio.run(run())
