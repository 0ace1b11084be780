"""Tenant authentication: `Authorization: Bearer lg-...` to the tenant a request runs as.

A key is looked up by its prefix and compared by sha256 in constant time (tenants.keys);
the answer, a tenant or a refusal, is cached in process for `ttl` seconds, so a request does
not touch the database and a revoked key or a suspended tenant is refused within `ttl`.
A key's `last_used_at` is written off the request path, when a key's answer is read from
the database (at most once per `ttl`) and the row's value, or this process's last write, is a
minute old or more: at most one write a minute per key and gateway replica, and none while
another replica wrote in the last minute. Writes only move it forward.

The tenant travels from here as a value, `RequestTenant`: the engine sees only its cache salt
(derived here, never taken from the client), its id as the fairness key and its weight.
`TenantDep` is the /v1 routes' dependency that resolves it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Protocol

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.http.errors import APIError
from gateway.tenancy.ratelimit import TenantLimits
from tenants.db import Database
from tenants.keys import find_key, hash_key, touch_keys
from tenants.models import TENANT_ACTIVE, ApiKey, Tenant

logger = logging.getLogger(__name__)

LAST_USED_INTERVAL = timedelta(minutes=1)
MAX_CACHED_KEYS = 100_000


@dataclass(frozen=True, slots=True)
class RequestTenant:
    """The tenant a request runs as, resolved once at the edge."""

    id: str
    name: str
    weight: float
    cache_salt: str
    key_id: str | None = None
    limits: TenantLimits = TenantLimits()
    # The base models it may use (and their adapters); None: every model.
    allowed_models: frozenset[str] | None = None
    # Tokens its unfinished batches may hold (tenants.models.Tenant); None: the server's.
    batch_token_limit: int | None = None


def cache_salt(secret_key: bytes, tenant: Tenant) -> str:
    """HMAC-SHA256 of the tenant's id, or of its cache group (tenants that opted in to share
    prefix-cache blocks): a salt no client can choose or learn from another tenant's."""
    subject = f"group:{tenant.cache_group}" if tenant.cache_group else f"tenant:{tenant.id}"
    return hmac.new(secret_key, subject.encode(), hashlib.sha256).hexdigest()


def request_tenant(secret_key: bytes, tenant: Tenant, key_id: str | None = None) -> RequestTenant:
    limits = TenantLimits(
        rpm=tenant.rpm_limit,
        tpm=tenant.tpm_limit,
        max_concurrency=tenant.max_concurrency,
        monthly_tokens=tenant.monthly_token_quota,
    )
    allowed = None if tenant.allowed_models is None else frozenset(tenant.allowed_models)
    return RequestTenant(
        tenant.id,
        tenant.name,
        tenant.weight,
        cache_salt(secret_key, tenant),
        key_id,
        limits,
        allowed,
        tenant.batch_token_limit,
    )


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


MISSING_KEY = (
    "You didn't provide an API key. Send it as a bearer token: `Authorization: Bearer lg-...`."
)
INVALID_KEY = "Incorrect API key provided."


def bearer_token(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class TenantAuth:
    def __init__(self, db: Database, secret_key: bytes, ttl: float) -> None:
        self.db = db
        self.secret_key = secret_key
        self.ttl = ttl
        # sha256 of a key -> (monotonic expiry, the tenant or the refusal it gets)
        self._cache: OrderedDict[str, tuple[float, RequestTenant | APIError]] = OrderedDict()
        self._last_used: dict[str, datetime] = {}  # key id -> last written
        self._writes: set[asyncio.Task[None]] = set()

    async def authenticate(self, authorization: str | None) -> RequestTenant:
        """The request's tenant; raises APIError 401 (missing, unknown or expired key) or 403
        (revoked key, suspended tenant)."""
        key = bearer_token(authorization)
        if key is None:
            raise _unauthorized(MISSING_KEY)
        digest = hash_key(key)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is None or cached[0] <= now:
            async with self.db.session() as session:
                found = await find_key(session, key)
            if found is None:
                raise _unauthorized(INVALID_KEY)  # not cached: a new key works at once
            cached = (now + self.ttl, self._judge(*found))
            self._cache[digest] = cached
            self._cache.move_to_end(digest)
            while len(self._cache) > MAX_CACHED_KEYS:
                self._cache.popitem(last=False)
            if isinstance(cached[1], RequestTenant):
                self._note_use(found[0])
        result = cached[1]
        if isinstance(result, APIError):
            raise result
        return result

    def _judge(self, key: ApiKey, tenant: Tenant) -> RequestTenant | APIError:
        if key.revoked_at is not None:
            return APIError(
                403, "This API key has been revoked.", type="permission_error", code="key_revoked"
            )
        if key.expires_at is not None and key.expires_at <= datetime.now(UTC):
            return _unauthorized("This API key has expired.")
        if tenant.status != TENANT_ACTIVE:
            return APIError(
                403, "This account is suspended.", type="permission_error", code="tenant_suspended"
            )
        return request_tenant(self.secret_key, tenant, key.id)

    def forget(self) -> None:
        """Drop every cached answer (after an admin change made in this process)."""
        self._cache.clear()

    async def drain(self) -> None:
        """Wait for the `last_used_at` writes under way (at shutdown)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def _note_use(self, key: ApiKey) -> None:
        now = datetime.now(UTC)
        # The newer of this process's last write (maybe not landed yet) and the row's (maybe
        # another replica's).
        known = [t for t in (self._last_used.get(key.id), key.last_used_at) if t is not None]
        if known and now - max(known) < LAST_USED_INTERVAL:
            return
        if len(self._last_used) >= MAX_CACHED_KEYS:
            self._last_used.clear()  # the rows' own values rule from here
        self._last_used[key.id] = now
        task = asyncio.create_task(self._write_last_used(key.id, now))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_last_used(self, key_id: str, when: datetime) -> None:
        try:
            async with self.db.session() as session, session.begin():
                await touch_keys(session, key_ids=[key_id], when=when)
        except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
            logger.warning("could not record the use of key %s", key_id, exc_info=True)


# Here only so that the OpenAPI schema names the security scheme: the key is read from the
# header by TenantAuth itself.
tenant_key = HTTPBearer(
    auto_error=False, scheme_name="TenantKey", description="A tenant's API key (lg-...)."
)


class _Tenants(Protocol):
    """What the dependency reads of the app's tenancy (gateway.tenancy.state.Tenancy)."""

    @property
    def no_auth_tenant(self) -> RequestTenant | None: ...

    @property
    def auth(self) -> TenantAuth: ...


async def current_tenant(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(tenant_key)]
) -> RequestTenant:
    tenancy: _Tenants = request.app.state.tenancy
    if tenancy.no_auth_tenant is not None:
        return tenancy.no_auth_tenant
    return await tenancy.auth.authenticate(request.headers.get("authorization"))


TenantDep = Annotated[RequestTenant, Depends(current_tenant)]
