"""The usage ledger's read side: token sums for billing and for tenants.

- `GET /admin/usage` (admin token): sums over a time range, for one tenant or all (or one
  batch's lines), in one row or grouped by day, tenant, model, adapter, key, endpoint or batch,
  or by day and one of the others;
  `top` keeps the biggest groups and merges the rest into `other` rows; JSON, or CSV with
  `Accept: text/csv`.
- `GET /admin/usage/completions` (admin token): buckets of a minute, an hour or a day in the
  shape of OpenAI's Usage API (`/v1/organization/usage/completions`), for tools built for it.
- `GET /v1/usage` (a tenant's key): the summary of `/admin/usage`, of the caller's tenant only
  (so no grouping by tenant).

`from` and `to` are ISO 8601 dates or date-times (`2026-11-01`, `2026-11-01T08:00:00Z`; without
an offset, UTC), the range half-open: `from=2026-11-01&to=2026-12-01` is November. The OpenAI
endpoint takes Unix seconds, as OpenAI's does. Rows reach the database within
--usage-flush-interval of their request's end.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from gateway.http.deps import AdminDep, TenancyDep
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS, OPENAI_ERRORS, error_response
from gateway.http.errors import APIError
from gateway.http.iso_time import Instant
from gateway.tenancy.auth import TenantDep
from gateway.tenancy.state import Tenancy
from tenants.usage import (
    BUCKET_LIMITS,
    MAX_EPOCH,
    MAX_PAGE,
    MAX_TOP,
    CompletionsQuery,
    Grouping,
    UsageQuery,
    UsageQueryError,
    UsageTotals,
    completions_page,
    grouping,
    summarize,
)

# Reads: no 404 (an unknown tenant has no usage), no 409, no engine to be busy.
_ADMIN = {k: v for k, v in ADMIN_ERRORS.items() if k not in (404, 409)}
_TENANT = {k: v for k, v in OPENAI_ERRORS.items() if k not in (404, 503)}
admin_router = APIRouter(
    prefix="/admin", tags=["usage"], route_class=StrictJSONRoute, responses=_ADMIN
)
router = APIRouter(prefix="/v1", tags=["usage"], route_class=StrictJSONRoute, responses=_TENANT)

SUMS = ("num_requests", "prompt_tokens", "cached_tokens", "completion_tokens")
GroupBy = Literal["day", "tenant", "model", "adapter", "key", "endpoint", "batch"]
# A key sees one tenant.
TenantGroupBy = Literal["day", "model", "adapter", "key", "endpoint", "batch"]
CompletionsGroup = Literal["project_id", "api_key_id", "model", "adapter"]
MAX_ID = 64
Id = Annotated[str, Field(max_length=MAX_ID)]
Name = Annotated[str, Field(max_length=256)]
_FROM = "ISO 8601 date or date-time (no offset: UTC), inclusive"
_TO = "ISO 8601 date or date-time (no offset: UTC), exclusive"
_LIMIT = "buckets per page: 1d: 7 by default, at most 31; 1h: 24, 168; 1m: 60, 1440"
_GROUP_BY = (
    "one grouping, or two: day and one other (`group_by=day&group_by=tenant`: a row per day "
    "and tenant)"
)
_BATCH_ID = "only the rows of this batch's lines (endpoint batch)"
_TOP = (
    "with a grouping other than day: the groups with the most tokens (prompt + completion) "
    "over the range keep their rows; the rest are summed into rows with `other: true` and a "
    "null group (one a day when grouped by day too)"
)


# -- answers --------------------------------------------------------------------------------------


class SummaryRow(BaseModel):
    """Sums of one group (its value under the group's name), or of everything."""

    day: str | None = Field(None, description="group_by=day: YYYY-MM-DD (UTC)")
    tenant: str | None = Field(None, description="group_by=tenant: the tenant's id")
    model: str | None = Field(None, description="group_by=model")
    adapter: str | None = Field(None, description="group_by=adapter: null is the base model")
    key: str | None = Field(None, description="group_by=key: the key's id; null: no key")
    endpoint: str | None = Field(
        None,
        description="group_by=endpoint: completions, chat, responses or batch; null: rows "
        "recorded before the endpoint was",
    )
    batch: str | None = Field(
        None, description="group_by=batch: the batch's id (its lines' rows); null: not a batch's"
    )
    other: bool | None = Field(
        None,
        description="with top, on every row: true for the sums of the groups outside the top "
        "(their group is null); false for a group of the top, null ones included",
    )
    num_requests: int
    prompt_tokens: int
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")
    completion_tokens: int


class Summary(BaseModel):
    object: Literal["list"] = "list"
    data: list[SummaryRow]


_SUMMARY: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The sums: days ascending; within a day (or without days) groups by "
        "value, null first, or with `top`, the top groups by their tokens over the range (most "
        "first), then the `other` row. CSV (a header row, then one row per group, the same "
        "columns) when asked with `Accept: text/csv`.",
        "content": {"text/csv": {"schema": {"type": "string"}}},
    },
    400: error_response(
        "A parameter out of bounds, or a rule between parameters broken (`invalid_value`): "
        "`group_by` twice must be `day` and one other; `top` needs a grouping other than day."
    ),
}


class CompletionsResult(BaseModel):
    object: Literal["organization.usage.completions.result"]
    input_tokens: int
    output_tokens: int
    input_cached_tokens: int
    input_audio_tokens: int
    output_audio_tokens: int
    num_model_requests: int
    project_id: str | None = Field(description="group_by=project_id: the tenant's id")
    user_id: None
    api_key_id: str | None
    model: str | None
    batch: None
    adapter: str | None = Field(description="group_by=adapter (ours): null is the base model")


class Bucket(BaseModel):
    object: Literal["bucket"]
    start_time: int
    end_time: int
    results: list[CompletionsResult]


class CompletionsPage(BaseModel):
    object: Literal["page"]
    data: list[Bucket]
    has_more: bool
    next_page: str | None


# -- routes ---------------------------------------------------------------------------------------


@admin_router.get(
    "/usage", response_model=Summary, response_model_exclude_unset=True, responses=_SUMMARY
)
async def admin_summary(
    request: Request,
    tenancy: TenancyDep,
    _: AdminDep,
    tenant_id: Annotated[str | None, Query(max_length=MAX_ID)] = None,
    start: Annotated[Instant | None, Query(alias="from", description=_FROM)] = None,
    end: Annotated[Instant | None, Query(alias="to", description=_TO)] = None,
    group_by: Annotated[list[GroupBy] | None, Query(max_length=2, description=_GROUP_BY)] = None,
    top: Annotated[int | None, Query(ge=1, le=MAX_TOP, description=_TOP)] = None,
    batch_id: Annotated[str | None, Query(max_length=MAX_ID, description=_BATCH_ID)] = None,
) -> Response | dict[str, Any]:
    """Token sums of every tenant, or of one (`tenant_id`)."""
    query = SummaryQuery(tenant_id, start, end, group_by or [], top, batch_id)
    return await _summary(request, tenancy, query)


@router.get("/usage", response_model=Summary, response_model_exclude_unset=True, responses=_SUMMARY)
async def tenant_summary(
    request: Request,
    tenancy: TenancyDep,
    tenant: TenantDep,
    start: Annotated[Instant | None, Query(alias="from", description=_FROM)] = None,
    end: Annotated[Instant | None, Query(alias="to", description=_TO)] = None,
    group_by: Annotated[
        list[TenantGroupBy] | None, Query(max_length=2, description=_GROUP_BY)
    ] = None,
    top: Annotated[int | None, Query(ge=1, le=MAX_TOP, description=_TOP)] = None,
    batch_id: Annotated[str | None, Query(max_length=MAX_ID, description=_BATCH_ID)] = None,
) -> Response | dict[str, Any]:
    """The caller's tenant's token sums (any of its keys)."""
    if "tenant_id" in request.query_params:
        raise APIError(
            400,
            "tenant_id: a key reads its own tenant's usage only",
            param="tenant_id",
            code="invalid_value",
        )
    query = SummaryQuery(tenant.id, start, end, group_by or [], top, batch_id)
    return await _summary(request, tenancy, query)


@admin_router.get("/usage/completions", response_model=CompletionsPage)
async def completions(
    tenancy: TenancyDep,
    _: AdminDep,
    start_time: Annotated[int, Query(ge=0, le=MAX_EPOCH, description="Unix seconds, inclusive")],
    end_time: Annotated[
        int | None, Query(ge=1, le=MAX_EPOCH + 1, description="Unix seconds, exclusive")
    ] = None,
    bucket_width: Literal["1m", "1h", "1d"] = "1d",
    group_by: Annotated[list[CompletionsGroup] | None, Query(max_length=8)] = None,
    group_by_brackets: Annotated[
        list[CompletionsGroup] | None, Query(alias="group_by[]", max_length=8)
    ] = None,
    limit: Annotated[
        int | None,
        Query(ge=1, le=max(m for _, m in BUCKET_LIMITS.values()), description=_LIMIT),
    ] = None,
    page: Annotated[str | None, Query(max_length=MAX_PAGE, description="a next_page")] = None,
    tenant_id: Annotated[str | None, Query(max_length=MAX_ID, description="ours")] = None,
    project_ids: Annotated[list[Id] | None, Query(max_length=100)] = None,
    api_key_ids: Annotated[list[Id] | None, Query(max_length=100)] = None,
    models: Annotated[list[Name] | None, Query(max_length=100)] = None,
) -> dict[str, Any]:
    """OpenAI's completions usage: a tenant is a project (`project_id`), a key's id its
    `api_key_id`; group_by takes `adapter` too. Lists come as repeated parameters, or with
    brackets (`group_by[]=model`) as OpenAI's SDKs send them."""
    projects = list(project_ids or []) + ([tenant_id] if tenant_id is not None else [])
    try:
        async with tenancy.db.session() as session:
            return await completions_page(
                session,
                CompletionsQuery(
                    start_time=start_time,
                    end_time=end_time,
                    bucket_width=bucket_width,
                    group_by=list(group_by or []) + list(group_by_brackets or []),
                    limit=limit,
                    page=page,
                    tenant_ids=projects,
                    api_key_ids=api_key_ids or [],
                    models=models or [],
                ),
            )
    except UsageQueryError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc


# The same page at OpenAI's own path, so that the openai SDK's admin client
# (`client.admin.organization.usage.completions(...)`, an admin token as its admin key) reads it.
organization_router = APIRouter(
    prefix="/v1/organization", tags=["usage"], route_class=StrictJSONRoute, responses=_ADMIN
)
organization_router.add_api_route(
    "/usage/completions", completions, methods=["GET"], response_model=CompletionsPage
)


@dataclass(frozen=True, slots=True)
class SummaryQuery:
    """A summary's query parameters: whose (None: every tenant's), from and to, the groups, and
    one batch's lines only (None: every row)."""

    tenant_id: str | None
    start: datetime | None
    end: datetime | None
    group_by: Sequence[str]
    top: int | None
    batch_id: str | None = None  # one batch's lines only


async def _summary(
    request: Request, tenancy: Tenancy, query: SummaryQuery
) -> Response | dict[str, Any]:
    first, stop = _epoch(query.start, "from"), _epoch(query.end, "to")
    if first is not None and stop is not None:
        stop = max(stop, first)  # to at or before from: the empty range, no rows
    group_by, top = query.group_by, query.top
    try:
        how = grouping(group_by, top)
    except UsageQueryError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc
    async with tenancy.db.session() as session:
        totals = await summarize(
            session, UsageQuery(first, stop, query.tenant_id, query.batch_id, group_by, top)
        )
    # The columns: the day, the other group, `other` with top, then the sums.
    groups = (["day"] if how.by_day else []) + ([how.name] if how.name else [])
    columns = groups + (["other"] if top is not None else []) + list(SUMS)
    rows = [_row(t, how, columns) for t in totals]
    if "text/csv" in request.headers.get("accept", ""):
        return _csv(rows, columns)
    return {"object": "list", "data": rows}


def _row(totals: UsageTotals, how: Grouping, columns: list[str]) -> dict[str, Any]:
    values = {"day": totals.day, how.name: totals.group, "other": totals.other}
    return {name: values[name] if name in values else getattr(totals, name) for name in columns}


def _epoch(value: datetime | None, param: str) -> int | None:
    if value is None:
        return None
    try:
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        return math.floor(moment.timestamp())
    except (OverflowError, ValueError, OSError) as exc:
        raise APIError(400, f"{param}: out of range", param=param, code="invalid_value") from exc


def _csv(rows: list[dict[str, Any]], columns: list[str]) -> Response:
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, lineterminator="\r\n")
    writer.writeheader()
    for row in rows:  # a boolean as JSON spells it, not Python
        writer.writerow({k: str(v).lower() if isinstance(v, bool) else v for k, v in row.items()})
    return Response(out.getvalue(), media_type="text/csv")
