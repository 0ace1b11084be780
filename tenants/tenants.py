"""Tenants: create, read, update, delete (keyword-only, one session each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, or_, select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import (
    Adapter,
    ApiKey,
    BatchLineRow,
    BatchRow,
    ConversationItemRow,
    ConversationRow,
    FileRow,
    StoredResponseRow,
    Tenant,
)
from tenants.names import check_tenant_name

MAX_TENANTS_PAGE = 1000
MAX_TENANT_QUERY = 64  # a search's length: a name's or an id's at most


class TenantExists(ValueError):
    pass


class UnknownCursor(ValueError):
    """A page asked to start after a tenant that does not exist (or no longer does)."""


@dataclass(frozen=True, slots=True)
class TenantPage:
    tenants: list[Tenant]
    has_more: bool  # tenants after the last of this page match too


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


async def page_tenants(
    session: AsyncSession,
    *,
    limit: int | None = None,
    after: str | None = None,
    q: str | None = None,
) -> TenantPage:
    """Tenants in the order they were created (created_at, then id), from the one after the
    tenant `after` (keyset: a tenant created meanwhile shifts no page), at most `limit` of them
    (None: all). `q` keeps the tenants whose name holds it, in any case, or whose id it is.
    Raises UnknownCursor for an `after` that names no tenant."""
    query = select(Tenant).order_by(Tenant.created_at, Tenant.id)
    if after is not None:
        # PostgreSQL refuses a string with a NUL outright; no id or name holds one anyway.
        cursor = None if "\x00" in after else await get_tenant(session, tenant_id=after)
        if cursor is None:
            raise UnknownCursor(f"after: no tenant {after!r}")
        position = tuple_(cursor.created_at, cursor.id)
        query = query.where(tuple_(Tenant.created_at, Tenant.id) > position)
    if q and "\x00" in q:
        return TenantPage([], has_more=False)
    if q:
        query = query.where(or_(Tenant.name.icontains(q, autoescape=True), Tenant.id == q))
    if limit is not None:
        query = query.limit(limit + 1)  # one more says whether there are more
    tenants = list(await session.scalars(query))
    if limit is None or len(tenants) <= limit:
        return TenantPage(tenants, has_more=False)
    return TenantPage(tenants[:limit], has_more=True)


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
    """Delete the tenant, its keys, adapters, stored responses, conversations, batches (with
    their lines) and files' rows; returns the deleted adapters' sha256s (their files may now
    be unreferenced). The files' bytes are the caller's to remove after
    (tenants.files.FileStore.remove_tenant)."""
    shas = list(await session.scalars(select(Adapter.sha256).where(Adapter.owner_id == tenant.id)))
    # Explicit, not ON DELETE CASCADE: SQLite enforces foreign keys only when asked to.
    await session.execute(delete(Adapter).where(Adapter.owner_id == tenant.id))
    await session.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant.id))
    # By hand, as keys: SQLite enforces the foreign keys' ON DELETE only when asked to (a
    # conversation's items first, as they cascade from it).
    await session.execute(delete(StoredResponseRow).where(StoredResponseRow.tenant_id == tenant.id))
    conversations = select(ConversationRow.id).where(ConversationRow.tenant_id == tenant.id)
    await session.execute(
        delete(ConversationItemRow).where(ConversationItemRow.conversation_id.in_(conversations))
    )
    await session.execute(delete(ConversationRow).where(ConversationRow.tenant_id == tenant.id))
    await session.execute(delete(FileRow).where(FileRow.tenant_id == tenant.id))
    batches = select(BatchRow.id).where(BatchRow.tenant_id == tenant.id)
    await session.execute(delete(BatchLineRow).where(BatchLineRow.batch_id.in_(batches)))
    await session.execute(delete(BatchRow).where(BatchRow.tenant_id == tenant.id))
    await session.delete(tenant)
    await session.flush()
    return shas
