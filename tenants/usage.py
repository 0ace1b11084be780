"""The usage ledger's read side: sums of the `usage` table (keyword-only, one session each).

Times are Unix seconds, ranges half-open [start, end). Buckets are integer arithmetic on
`created_epoch` (`created_epoch - created_epoch % width`), the same on SQLite and PostgreSQL,
and UTC: a day is 00:00 to 24:00 UTC.

`completions_page` answers in the shape of OpenAI's Usage API (`GET
/v1/organization/usage/completions`), so that tools built for it read ours: a tenant is a
project, a key's id its `api_key_id`; `adapter` is ours.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, func, literal_column, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import Usage

DAY = 86400
MAX_EPOCH = 253402300799  # 9999-12-31T23:59:59Z
SUMMARY_GROUPS = ("day", "model", "adapter", "key", "endpoint")
BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": DAY}
# OpenAI's: buckets per page, (default, max) by width.
BUCKET_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
COMPLETION_GROUPS = ("project_id", "api_key_id", "model", "adapter")
RESULT_OBJECT = "organization.usage.completions.result"


class UsageQueryError(ValueError):
    """A query that cannot be answered; `param` names the parameter at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class UsageTotals:
    group: str | None  # the group's value (a day as YYYY-MM-DD); None: ungrouped, or null
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def _sums() -> list[ColumnElement[Any]]:
    return [
        func.count().label("num_requests"),
        func.coalesce(func.sum(Usage.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(Usage.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(Usage.completion_tokens), 0).label("completion_tokens"),
    ]


def _bucket(width: int) -> ColumnElement[int]:
    # The width inline, not a bound parameter: PostgreSQL matches a grouped expression to the
    # selected one by its text, and two parameters ($1, $2) would not match.
    width_sql: ColumnElement[int] = literal_column(str(int(width)))
    return Usage.created_epoch - Usage.created_epoch % width_sql


def _in_range(query: Select[Any], start: int | None, end: int | None) -> Select[Any]:
    if start is not None:
        query = query.where(Usage.created_epoch >= start)
    if end is not None:
        query = query.where(Usage.created_epoch < end)
    return query


def _day(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).date().isoformat()


async def summarize_usage(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    start: int | None = None,
    end: int | None = None,
    group_by: str | None = None,
) -> list[UsageTotals]:
    """Sums over [start, end), one row per group (by `group_by`: day, model, adapter, key
    or endpoint), or one row of everything (zeros when nothing matched). Groups come in order:
    days ascending, names with null (the base model, no key, rows from before endpoints were
    recorded) first."""
    column: Any = {
        "day": _bucket(DAY),
        "model": Usage.model,
        "adapter": Usage.adapter_name,
        "key": Usage.key_id,
        "endpoint": Usage.endpoint,
        None: None,
    }[group_by]
    query: Select[Any] = select(*_sums())
    if column is not None:
        query = select(column.label("grp"), *_sums()).group_by(column)
    if tenant_id is not None:
        query = query.where(Usage.tenant_id == tenant_id)
    rows = (await session.execute(_in_range(query, start, end))).all()
    totals = []
    for row in rows:
        group: Any = row.grp if column is not None else None
        if group_by == "day":
            group = _day(int(group))
        totals.append(
            UsageTotals(
                group,
                int(row.num_requests),
                int(row.prompt_tokens),
                int(row.cached_tokens),
                int(row.completion_tokens),
            )
        )
    return sorted(totals, key=lambda t: (t.group is not None, t.group or ""))


async def tokens_used(session: AsyncSession, *, tenant_id: str, since: datetime) -> int:
    """Prompt and completion tokens the tenant's requests used since `since` (a quota's
    start)."""
    query = select(func.coalesce(func.sum(Usage.prompt_tokens + Usage.completion_tokens), 0)).where(
        Usage.tenant_id == tenant_id, Usage.created_epoch >= int(since.timestamp())
    )
    used: Any = await session.scalar(query)
    return int(used or 0)


# -- OpenAI's Usage API ---------------------------------------------------------------------------


# A next_page is "page_" and the base64 of a bucket's start: never longer than this.
MAX_PAGE = 32


def encode_page(bucket_start: int) -> str:
    return "page_" + base64.urlsafe_b64encode(str(bucket_start).encode()).decode().rstrip("=")


def decode_page(page: str) -> int:
    """Raises UsageQueryError for anything `encode_page` did not make."""
    try:
        if not page.startswith("page_") or len(page) > MAX_PAGE:
            raise ValueError
        text = base64.urlsafe_b64decode(page[5:] + "=" * (-len(page[5:]) % 4)).decode()
        if not text.isdigit():
            raise ValueError
        return int(text)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise UsageQueryError("page", "page: not a next_page this server returned") from None


def _width_and_limit(bucket_width: str, limit: int | None) -> tuple[int, int]:
    if bucket_width not in BUCKET_WIDTHS:
        raise UsageQueryError("bucket_width", "bucket_width: one of 1m, 1h, 1d")
    default, most = BUCKET_LIMITS[bucket_width]
    if limit is not None and not 1 <= limit <= most:
        raise UsageQueryError("limit", f"limit: 1 to {most} for bucket_width={bucket_width}")
    return BUCKET_WIDTHS[bucket_width], limit or default


async def completions_page(
    session: AsyncSession,
    *,
    start_time: int,
    end_time: int | None = None,
    bucket_width: str = "1d",
    group_by: Sequence[str] = (),
    limit: int | None = None,
    page: str | None = None,
    tenant_ids: Sequence[str] = (),
    api_key_ids: Sequence[str] = (),
    models: Sequence[str] = (),
    now: int | None = None,
) -> dict[str, Any]:
    """One page of buckets from start_time (snapped down to its minute, hour or day) to
    end_time (exclusive; default now), every bucket listed, empty ones too. Raises
    UsageQueryError for parameters out of bounds."""
    width, limit = _width_and_limit(bucket_width, limit)
    if not 0 <= start_time <= MAX_EPOCH:
        raise UsageQueryError("start_time", f"start_time: Unix seconds in [0, {MAX_EPOCH}]")
    end = int(datetime.now(UTC).timestamp()) if now is None else now
    if end_time is not None:
        if not 0 < end_time <= MAX_EPOCH + 1:
            raise UsageQueryError("end_time", f"end_time: Unix seconds in [1, {MAX_EPOCH + 1}]")
        end = max(end_time, start_time)  # an empty or backwards range: no buckets
    unknown = [g for g in group_by if g not in COMPLETION_GROUPS]
    if unknown:
        raise UsageQueryError("group_by", f"group_by: one of {', '.join(COMPLETION_GROUPS)}")
    first = start_time - start_time % width
    if page is not None:
        cursor = decode_page(page)
        if cursor % width or not first <= cursor < end:
            raise UsageQueryError("page", "page: not a next_page of this query")
        first = cursor
    # buckets that start before `end`; none for an empty range
    total = max(0, -(-(end - first) // width)) if end > start_time else 0
    count = min(limit, total)
    stop = first + count * width

    columns = {
        "project_id": Usage.tenant_id,
        "api_key_id": Usage.key_id,
        "model": Usage.model,
        "adapter": Usage.adapter_name,
    }
    groups = [g for g in COMPLETION_GROUPS if g in group_by]
    bucket = _bucket(width)
    keys: list[Any] = [bucket.label("bucket")] + [columns[g].label(g) for g in groups]
    query: Select[Any] = select(*keys, *_sums())
    query = query.group_by(bucket, *(columns[g] for g in groups))
    query = _in_range(query, max(start_time, first), min(end, stop))
    for column, values in (
        (Usage.tenant_id, tenant_ids),
        (Usage.key_id, api_key_ids),
        (Usage.model, models),
    ):
        if values:
            query = query.where(column.in_(list(values)))
    results: dict[int, list[dict[str, Any]]] = {first + i * width: [] for i in range(count)}
    if count:
        for row in (await session.execute(query)).all():
            results[int(row.bucket)].append(_result(row, groups))
    for found in results.values():
        found.sort(key=lambda r: tuple((r[g] is not None, r[g] or "") for g in groups))
    return {
        "object": "page",
        "data": [
            {"object": "bucket", "start_time": s, "end_time": s + width, "results": results[s]}
            for s in sorted(results)
        ],
        "has_more": total > count,
        "next_page": encode_page(stop) if total > count else None,
    }


def _result(row: Any, groups: list[str]) -> dict[str, Any]:
    """One result, as OpenAI writes it: the fields of groups not asked for are null."""
    return {
        "object": RESULT_OBJECT,
        "input_tokens": int(row.prompt_tokens),
        "output_tokens": int(row.completion_tokens),
        "input_cached_tokens": int(row.cached_tokens),
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": int(row.num_requests),
        "project_id": None,
        "user_id": None,
        "api_key_id": None,
        "model": None,
        "batch": None,
        "adapter": None,
    } | {g: getattr(row, g) for g in groups}
