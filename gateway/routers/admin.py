"""Admin REST for tenants and their API keys, under /admin (an admin token on every route).

A key is shown once, in the answer that creates it; lists never show secrets. Changes take
effect in this process at once (its caches are dropped) and in other gateway replicas within
--tenant-cache-ttl.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from gateway.http.deps import AdminDep, TenancyDep
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS, error_response, not_found
from gateway.http.errors import APIError
from gateway.http.iso_time import Instant
from gateway.tenancy.state import Tenancy
from tenants.keys import create_key, list_keys, revoke_key
from tenants.models import ApiKey, Tenant
from tenants.names import MAX_TENANT_NAME, TENANT_NAME_PATTERN, check_tenant_name
from tenants.tenants import (
    MAX_TENANT_QUERY,
    MAX_TENANTS_PAGE,
    TenantExists,
    UnknownCursor,
    create_tenant,
    delete_tenant,
    get_tenant,
    page_tenants,
    update_tenant,
)
from tenants.usage import month_tokens

router = APIRouter(
    prefix="/admin", tags=["admin"], route_class=StrictJSONRoute, responses=ADMIN_ERRORS
)

TenantName = Annotated[
    str,
    Field(min_length=1, max_length=MAX_TENANT_NAME, pattern=TENANT_NAME_PATTERN),
    AfterValidator(check_tenant_name),
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _json_number(value: object) -> object:
    # A billing limit is a JSON number: "1000" or true is a mistake, not a number to coerce.
    # (1000.0 is an integer to JSON Schema and stays one; 10.5 is refused as a fraction.)
    if isinstance(value, str | bool):
        raise ValueError("a JSON integer, not a string or a boolean")
    return value


# The served models a tenant may use, by name; null: every model.
MAX_ALLOWED_MODELS = 64
ModelName = Annotated[str, Field(min_length=1, max_length=256)]
AllowedModels = Annotated[
    list[ModelName],
    Field(
        max_length=MAX_ALLOWED_MODELS,
        description=(
            "The served models (by the `model` name clients send) the tenant may use, and so "
            "their adapters; any other is a 404 `model_not_found`, as a model that does not "
            "exist. null: every model."
        ),
    ),
]

# Per-tenant limits; null is unlimited. A limit of 2^53 or more is as good as none.
RequestLimit = Annotated[int, Field(ge=1, lt=1 << 53), BeforeValidator(_json_number)]
TokenQuota = Annotated[int, Field(ge=0, lt=1 << 53), BeforeValidator(_json_number)]
LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrency", "monthly_token_quota")
# Fields where a PATCH's null is a value (no group, unlimited, every model, the server's
# batch cap), not "unchanged".
NULLABLE_FIELDS = ("cache_group", "allowed_models", *LIMIT_FIELDS, "batch_token_limit")


class _Limits(_In):
    rpm_limit: RequestLimit | None = Field(None, description="Requests per minute.")
    tpm_limit: RequestLimit | None = Field(
        None, description="Tokens per minute: prompt + max_tokens reserved, actual kept."
    )
    max_concurrency: RequestLimit | None = Field(None, description="Requests in flight.")
    monthly_token_quota: TokenQuota | None = Field(
        None, description="Prompt + completion tokens per calendar month (UTC)."
    )
    batch_token_limit: TokenQuota | None = Field(
        None,
        description="Tokens (each line's prompt + max_tokens) its unfinished batches may hold; "
        "a batch past it is a 429 `token_limit_exceeded`. null: the server's "
        "--batch-token-limit (unlimited unless set).",
    )


class TenantCreate(_Limits):
    """A limit left out takes the server's default (--default-rpm-limit, ...); null is
    unlimited."""

    name: TenantName
    weight: float = Field(1.0, gt=0.0, le=1000.0)
    cache_group: TenantName | None = None
    allowed_models: AllowedModels | None = None


class TenantUpdate(_Limits):
    """Fields to change. null leaves a field as it is, but for cache_group (null leaves the
    group), allowed_models (null allows every model) and the limits (null lifts the limit)."""

    name: TenantName | None = None
    status: Literal["active", "suspended"] | None = None
    weight: float | None = Field(None, gt=0.0, le=1000.0)
    cache_group: TenantName | None = None
    allowed_models: AllowedModels | None = None


class TenantPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    status: Literal["active", "suspended"]
    weight: float
    cache_group: str | None
    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrency: int | None
    monthly_token_quota: int | None
    batch_token_limit: int | None
    allowed_models: list[str] | None
    created_at: datetime


class TenantListed(TenantPublic):
    month_tokens: int = Field(
        description="Prompt + completion tokens of the current calendar month (UTC)."
    )


class TenantList(BaseModel):
    """A page of tenants in OpenAI's list shape."""

    object: Literal["list"] = "list"
    data: list[TenantListed]
    first_id: str | None = Field(description="The first tenant's id; null: an empty page.")
    last_id: str | None = Field(description="The last tenant's id: the next page's `after`.")
    has_more: bool


class KeyCreate(_In):
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    expires_at: (
        Annotated[
            Instant,
            Field(description="ISO 8601 date-time in the future (no offset: UTC)"),
        ]
        | None
    ) = None


class KeyPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["api_key"] = "api_key"
    tenant_id: str
    name: str | None
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None


class KeyCreated(KeyPublic):
    key: str = Field(description="The key itself: shown in this answer only.")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyPublic]


def _served(tenancy: Tenancy, allowed_models: list[str] | None) -> list[str] | None:
    """The list as stored (each name once, in the order given), every name a served model's;
    else 400 naming the first that is not."""
    if allowed_models is None:
        return None
    served = tenancy.model_names
    for name in allowed_models:
        if name not in served:
            raise APIError(
                400,
                f"allowed_models: {name!r} is not a model this server serves "
                f"({', '.join(map(repr, served))})",
                param="allowed_models",
                code="invalid_value",
            )
    return list(dict.fromkeys(allowed_models))


async def tenant_or_404(tenancy: Tenancy, tenant_id: str) -> Tenant:
    """The tenant; 404 `not_found` (param tenant_id) for an id that names none."""
    async with tenancy.db.session() as session:
        tenant = await get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        raise not_found("tenant", "tenant_id")
    return tenant


# The one 400 a schema cannot foresee: which models this server serves.
_TENANT_400: dict[int | str, dict[str, Any]] = {
    400: error_response(
        "A field out of bounds, or an `allowed_models` name that is not a model this server "
        "serves (`invalid_value`)."
    )
}


@router.post("/tenants", status_code=201, response_model=TenantPublic, responses=_TENANT_400)
async def create(body: TenantCreate, tenancy: TenancyDep, _: AdminDep) -> Tenant:
    fields = body.model_dump()
    fields["allowed_models"] = _served(tenancy, body.allowed_models)
    for name in LIMIT_FIELDS:
        if name not in body.model_fields_set:
            fields[name] = tenancy.default_limits.get(name)
    try:
        async with tenancy.db.session() as session, session.begin():
            return await create_tenant(session, **fields)
    except TenantExists as exc:
        raise APIError(409, str(exc), param="name", code="tenant_exists") from exc


_LIST_400: dict[int | str, dict[str, Any]] = {
    400: error_response(
        "A parameter out of bounds, or an `after` that names no tenant (`invalid_value`)."
    )
}


@router.get("/tenants", response_model=TenantList, responses=_LIST_400)
async def list_all(
    tenancy: TenancyDep,
    _: AdminDep,
    limit: Annotated[
        int | None,
        Query(ge=1, le=MAX_TENANTS_PAGE, description="Tenants per page; left out: all of them."),
    ] = None,
    after: Annotated[
        str | None,
        Query(max_length=64, description="A tenant's id: the page starts after it."),
    ] = None,
    q: Annotated[
        str | None,
        Query(
            max_length=MAX_TENANT_QUERY,
            description="Only tenants whose name holds this (in any case), or whose id it is.",
        ),
    ] = None,
) -> dict[str, Any]:
    """Tenants in the order they were created (`created_at`, then `id`), a page at a time:
    `after` the previous page's `last_id` while `has_more`. Each with this month's tokens."""
    async with tenancy.db.session() as session:
        try:
            page = await page_tenants(session, limit=limit, after=after, q=q)
        except UnknownCursor as exc:
            raise APIError(400, str(exc), param="after", code="invalid_value") from exc
        used = await month_tokens(session, tenant_ids=[t.id for t in page.tenants])
    data = [
        TenantPublic.model_validate(t).model_dump() | {"month_tokens": used[t.id]}
        for t in page.tenants
    ]
    return {
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": page.has_more,
    }


@router.get("/tenants/{tenant_id}", response_model=TenantPublic)
async def read(tenant_id: str, tenancy: TenancyDep, _: AdminDep) -> Tenant:
    return await tenant_or_404(tenancy, tenant_id)


@router.patch("/tenants/{tenant_id}", response_model=TenantPublic, responses=_TENANT_400)
async def update(tenant_id: str, body: TenantUpdate, tenancy: TenancyDep, _: AdminDep) -> Tenant:
    """Rename, re-weigh, regroup, change limits or the models allowed; `status` suspends
    (`suspended`) or reactivates (`active`)."""
    changes = {
        k: v
        for k, v in body.model_dump(exclude_unset=True).items()
        if v is not None or k in NULLABLE_FIELDS
    }
    if "allowed_models" in changes:
        changes["allowed_models"] = _served(tenancy, changes["allowed_models"])
    try:
        async with tenancy.db.session() as session, session.begin():
            tenant = await get_tenant(session, tenant_id=tenant_id)
            if tenant is None:
                raise not_found("tenant", "tenant_id")
            await update_tenant(session, tenant=tenant, **changes)
    except TenantExists as exc:
        raise APIError(409, str(exc), param="name", code="tenant_exists") from exc
    # A suspension, a new cache group, new limits or models allowed apply at once.
    tenancy.auth.forget()
    return tenant


@router.delete("/tenants/{tenant_id}", status_code=204, response_class=Response)
async def delete(tenant_id: str, tenancy: TenancyDep, _: AdminDep) -> Response:
    """Delete the tenant with its keys, adapters, stored responses, conversations and files."""
    async with tenancy.db.session() as session, session.begin():
        tenant = await get_tenant(session, tenant_id=tenant_id)
        if tenant is None:
            raise not_found("tenant", "tenant_id")
        shas = await delete_tenant(session, tenant=tenant)
    tenancy.auth.forget()
    tenancy.catalog.forget()
    await tenancy.catalog.release(shas)
    if tenancy.files is not None:  # their rows went with the tenant; now their bytes
        await tenancy.files.remove_tenant(tenant_id)
    return Response(status_code=204)


@router.post("/tenants/{tenant_id}/keys", status_code=201, response_model=KeyCreated)
async def create_tenant_key(
    tenant_id: str, body: KeyCreate, tenancy: TenancyDep, _: AdminDep
) -> dict[str, Any]:
    await tenant_or_404(tenancy, tenant_id)
    expires = body.expires_at
    if expires is not None and expires.tzinfo is None:
        expires = expires.replace(tzinfo=UTC)  # no offset: UTC, as the store reads it
    if expires is not None and expires <= datetime.now(UTC):
        # A key born expired is a mistake (the schema cannot say "after now": a 400 of ours).
        raise APIError(
            400, "expires_at: not in the future", param="expires_at", code="invalid_value"
        )
    async with tenancy.db.session() as session, session.begin():
        row, key = await create_key(
            session, tenant_id=tenant_id, name=body.name, expires_at=body.expires_at
        )
    return KeyPublic.model_validate(row).model_dump() | {"key": key}


@router.get("/tenants/{tenant_id}/keys", response_model=KeyList)
async def list_tenant_keys(tenant_id: str, tenancy: TenancyDep, _: AdminDep) -> dict[str, Any]:
    await tenant_or_404(tenancy, tenant_id)
    async with tenancy.db.session() as session:
        return {"data": await list_keys(session, tenant_id=tenant_id)}


@router.delete("/keys/{key_id}", response_model=KeyPublic)
async def revoke(key_id: str, tenancy: TenancyDep, _: AdminDep) -> ApiKey:
    """Revoke a key: requests with it get 403 `key_revoked` (within --tenant-cache-ttl on other
    replicas; at once on this one)."""
    async with tenancy.db.session() as session, session.begin():
        row = await revoke_key(session, key_id=key_id)
    if row is None:
        raise not_found("key", "key_id")
    tenancy.auth.forget()
    return row
