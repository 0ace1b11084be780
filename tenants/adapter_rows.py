"""Adapter rows: who owns which adapter under which name (the files are the store's).

A tenant sees the public adapters (owner NULL) and its own; its own name wins over a
public one of the same name.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import PUBLIC_SCOPE, Adapter
from tenants.names import check_adapter_name


class AdapterExists(ValueError):
    pass


def scope_of(owner_id: str | None) -> str:
    return PUBLIC_SCOPE if owner_id is None else owner_id


async def create_adapter(
    session: AsyncSession, *, owner_id: str | None, name: str, **fields: Any
) -> Adapter:
    """Raises AdapterExists for a name the owner already uses (the session must then roll
    back)."""
    row = Adapter(owner_id=owner_id, scope=scope_of(owner_id), name=check_adapter_name(name))
    for key, value in fields.items():
        setattr(row, key, value)
    session.add(row)
    try:
        await session.flush()
    except IntegrityError as exc:
        raise AdapterExists(f"an adapter named {name!r} exists") from exc
    return row


async def name_taken(session: AsyncSession, *, owner_id: str | None, name: str) -> bool:
    found = await session.scalar(
        select(Adapter.id).where(Adapter.scope == scope_of(owner_id), Adapter.name == name)
    )
    return found is not None


async def get_adapter(session: AsyncSession, *, adapter_id: str) -> Adapter | None:
    return await session.get(Adapter, adapter_id)


async def get_by_name(session: AsyncSession, *, owner_id: str | None, name: str) -> Adapter | None:
    return await session.scalar(
        select(Adapter).where(Adapter.scope == scope_of(owner_id), Adapter.name == name)
    )


async def list_adapters(session: AsyncSession, *, owner_id: str | None = None) -> list[Adapter]:
    """Every adapter, or (owner_id given) that tenant's own."""
    query = select(Adapter).order_by(Adapter.created_at, Adapter.id)
    if owner_id is not None:
        query = query.where(Adapter.owner_id == owner_id)
    return list(await session.scalars(query))


async def visible_adapters(session: AsyncSession, *, tenant_id: str) -> dict[str, Adapter]:
    """Name -> adapter, for the names a tenant's `model` field may use."""
    rows = await session.scalars(
        select(Adapter).where(or_(Adapter.owner_id == tenant_id, Adapter.owner_id.is_(None)))
    )
    visible: dict[str, Adapter] = {}
    for row in rows:
        if row.owner_id is not None or row.name not in visible:
            visible[row.name] = row
    return visible


async def delete_adapter(session: AsyncSession, *, adapter: Adapter) -> None:
    await session.delete(adapter)
    await session.flush()


async def is_referenced(session: AsyncSession, *, sha256: str) -> bool:
    return await session.scalar(select(Adapter.id).where(Adapter.sha256 == sha256)) is not None


async def referenced_shas(session: AsyncSession) -> set[str]:
    return set(await session.scalars(select(Adapter.sha256).distinct()))
