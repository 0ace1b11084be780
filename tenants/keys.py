"""API keys: minted, stored as a prefix and a sha256, looked up, revoked.

A key is `lg-` and 32 random bytes (url-safe base64); it is shown once, at creation. The
database keeps its first characters (the prefix, to find it by and to show) and the sha256
of the whole key; a lookup compares hashes in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import ApiKey, Tenant, utcnow

KEY_PREFIX = "lg-"
PREFIX_LEN = len(KEY_PREFIX) + 8
MAX_KEY_LEN = 128


@dataclass(frozen=True, slots=True)
class MintedKey:
    key: str
    prefix: str
    key_hash: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def mint_key() -> MintedKey:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return MintedKey(key, key[:PREFIX_LEN], hash_key(key))


def looks_like_key(value: str) -> bool:
    return value.startswith(KEY_PREFIX) and PREFIX_LEN < len(value) <= MAX_KEY_LEN


async def create_key(
    session: AsyncSession,
    *,
    tenant_id: str,
    name: str | None = None,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """A new key for the tenant: its row, and the key itself (never stored)."""
    minted = mint_key()
    row = ApiKey(
        tenant_id=tenant_id,
        name=name,
        prefix=minted.prefix,
        key_hash=minted.key_hash,
        expires_at=expires_at,
    )
    session.add(row)
    await session.flush()
    return row, minted.key


async def find_key(session: AsyncSession, key: str) -> tuple[ApiKey, Tenant] | None:
    """The key's row and tenant, whatever their state (the caller decides what a revoked key
    or a suspended tenant gets); None for a key that does not exist."""
    if not looks_like_key(key):
        return None
    wanted = hash_key(key)
    rows = await session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.prefix == key[:PREFIX_LEN])
    )
    for api_key, tenant in rows:
        if hmac.compare_digest(api_key.key_hash, wanted):
            return api_key, tenant
    return None


async def list_keys(session: AsyncSession, *, tenant_id: str) -> list[ApiKey]:
    rows = await session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
    )
    return list(rows)


async def revoke_key(session: AsyncSession, *, key_id: str) -> ApiKey | None:
    row = await session.get(ApiKey, key_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


async def touch_keys(session: AsyncSession, *, key_ids: list[str], when: datetime) -> None:
    """Set the keys' `last_used_at` to `when` where it is older (gateway replicas' writes may
    land out of order: the newest stays)."""
    newer = or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < when)
    await session.execute(
        update(ApiKey).where(ApiKey.id.in_(key_ids), newer).values(last_used_at=when)
    )
