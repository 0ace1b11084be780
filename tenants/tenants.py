"""Tenants: create, read, update, delete (keyword-only, one session each)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import Adapter, ApiKey, StoredResponseRow, Tenant
from tenants.names import check_tenant_name


class TenantExists(ValueError):
    pass


async def create_tenant(session: AsyncSession, *, name: str, **fields: Any) -> Tenant:
    """Raises TenantExists for a name in use (the session must then roll back), ValueError for
    a bad name."""
    tenant = Tenant(name=check_tenant_name(name), **fields)
    session.add(tenant)
    try:
        await session.flush()
    except IntegrityError as exc:
        raise TenantExists(f"a tenant named {name!r} exists") from exc
    return tenant


async def get_tenant(session: AsyncSession, *, tenant_id: str) -> Tenant | None:
    return await session.get(Tenant, tenant_id)


async def get_tenant_by_name(session: AsyncSession, *, name: str) -> Tenant | None:
    return await session.scalar(select(Tenant).where(Tenant.name == name))


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    return list(await session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id)))


async def count_tenants(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.count()).select_from(Tenant)) or 0)


async def update_tenant(session: AsyncSession, *, tenant: Tenant, **fields: Any) -> Tenant:
    """Raises TenantExists for a new name in use (the session must then roll back)."""
    if "name" in fields:
        check_tenant_name(fields["name"])
    for name, value in fields.items():
        setattr(tenant, name, value)
    try:
        await session.flush()
    except IntegrityError as exc:
        raise TenantExists(f"a tenant named {fields.get('name')!r} exists") from exc
    return tenant


async def delete_tenant(session: AsyncSession, *, tenant: Tenant) -> list[str]:
    """Delete the tenant, its keys and its adapters; returns the deleted adapters' sha256s
    (their files may now be unreferenced)."""
    shas = list(await session.scalars(select(Adapter.sha256).where(Adapter.owner_id == tenant.id)))
    # Explicit, not ON DELETE CASCADE: SQLite enforces foreign keys only when asked to.
    await session.execute(delete(Adapter).where(Adapter.owner_id == tenant.id))
    await session.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant.id))
    # By hand, as keys: SQLite enforces the foreign keys' ON DELETE only when asked to.
    await session.execute(delete(StoredResponseRow).where(StoredResponseRow.tenant_id == tenant.id))
    await session.delete(tenant)
    await session.flush()
    return shas
