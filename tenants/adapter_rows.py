"""Adapter rows: who owns which adapter under which name, on which base model (the files are
the store's).

A name is unique per owner and base model: one owner may have `sql` on two base models. A
tenant sees the public adapters (owner NULL) and its own; on one base model, its own name wins
over a public one of the same name.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import PUBLIC_SCOPE, Adapter
from tenants.names import check_adapter_name


class AdapterExists(ValueError):
    pass


def scope_of(owner_id: str | None) -> str:
    return PUBLIC_SCOPE if owner_id is None else owner_id


def adapter_exists(name: str, base_model: str) -> AdapterExists:
    return AdapterExists(f"an adapter named {name!r} exists on base model {base_model!r}")


async def create_adapter(
    session: AsyncSession, *, owner_id: str | None, name: str, base_model: str, **fields: Any
) -> Adapter:
    """Raises AdapterExists for a name the owner already uses on that base model (the session
    must then roll back)."""
    row = Adapter(
        owner_id=owner_id,
        scope=scope_of(owner_id),
        name=check_adapter_name(name),
        base_model=base_model,
    )
    for key, value in fields.items():
        setattr(row, key, value)
    session.add(row)
    try:
        await session.flush()
    except IntegrityError as exc:
        raise adapter_exists(name, base_model) from exc
    return row


async def name_taken(
    session: AsyncSession, *, owner_id: str | None, base_model: str, name: str
) -> bool:
    return (
        await get_by_name(session, owner_id=owner_id, base_model=base_model, name=name) is not None
    )


async def get_adapter(session: AsyncSession, *, adapter_id: str) -> Adapter | None:
    return await session.get(Adapter, adapter_id)


async def get_by_name(
    session: AsyncSession, *, owner_id: str | None, base_model: str, name: str
) -> Adapter | None:
    return await session.scalar(
        select(Adapter).where(
            Adapter.scope == scope_of(owner_id),
            Adapter.base_model == base_model,
            Adapter.name == name,
        )
    )


async def find_by_name(session: AsyncSession, *, owner_id: str | None, name: str) -> list[Adapter]:
    """The owner's adapters of that name, one per base model it is on."""
    query = select(Adapter).where(Adapter.scope == scope_of(owner_id), Adapter.name == name)
    return list(await session.scalars(query.order_by(Adapter.base_model)))


async def list_adapters(session: AsyncSession, *, owner_id: str | None = None) -> list[Adapter]:
    """Every adapter, or (owner_id given) that tenant's own."""
    query = select(Adapter).order_by(Adapter.created_at, Adapter.id)
    if owner_id is not None:
        query = query.where(Adapter.owner_id == owner_id)
    return list(await session.scalars(query))


async def visible_adapters(
    session: AsyncSession, *, tenant_id: str
) -> dict[tuple[str, str], Adapter]:
    """(name, base model) -> adapter, for the adapters a tenant's `model` field may name: its
    own, and the public ones it has no adapter of the same name on the same base model for."""
    rows = await session.scalars(
        select(Adapter).where(or_(Adapter.owner_id == tenant_id, Adapter.owner_id.is_(None)))
    )
    visible: dict[tuple[str, str], Adapter] = {}
    for row in rows:
        key = (row.name, row.base_model)
        if row.owner_id is not None or key not in visible:
            visible[key] = row
    return visible


async def delete_adapter(session: AsyncSession, *, adapter: Adapter) -> None:
    await session.delete(adapter)
    await session.flush()


async def is_referenced(session: AsyncSession, *, sha256: str) -> bool:
    return await session.scalar(select(Adapter.id).where(Adapter.sha256 == sha256)) is not None


async def count_by_base_model(session: AsyncSession) -> dict[str, int]:
    rows = await session.execute(
        select(Adapter.base_model, func.count()).group_by(Adapter.base_model)
    )
    return {base_model: count for base_model, count in rows}


async def adapters_with_weights(session: AsyncSession, *, shas: Collection[str]) -> list[Adapter]:
    """The adapters whose files are one of `shas` (several rows may share one)."""
    if not shas:
        return []
    query = select(Adapter).where(Adapter.sha256.in_(sorted(shas)))
    return list(await session.scalars(query.order_by(Adapter.created_at, Adapter.id)))


async def referenced_shas(session: AsyncSession) -> set[str]:
    return set(await session.scalars(select(Adapter.sha256).distinct()))
