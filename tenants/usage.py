"""The usage ledger's read side: sums of the `usage` table (one session each; the
parameters keyword-only, or one query object).

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
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, case, false, func, literal_column, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import Usage

DAY = 86400
MAX_EPOCH = 253402300799  # 9999-12-31T23:59:59Z
SUMMARY_GROUPS = ("day", "tenant", "model", "adapter", "key", "endpoint", "batch")
MAX_TOP = 50
# The IN list of a month_tokens query is at most this long; past it, every tenant's month is
# summed (one query either way) rather than binding thousands of parameters.
MAX_TENANTS_IN = 1000
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
    group: str | None  # the group's value (a day as YYYY-MM-DD); None: ungrouped, null, other
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    day: str | None = None  # grouped by day (alone or with another grouping): YYYY-MM-DD
    other: bool = False  # with `top`: the sums of every group outside the top

    @property
    def tokens(self) -> int:
        """What a group is ranked by, and a quota counts: prompt + completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Grouping:
    """A summary's groups: by day or not, by at most one other column (`name`), and whether
    only the `top` groups of that column keep rows of their own."""

    by_day: bool
    name: str | None  # tenant, model, adapter, key, endpoint or batch
    top: int | None


# Grouping names and their columns (day is a bucket of created_epoch).
GROUP_COLUMNS: dict[str, Any] = {
    "tenant": Usage.tenant_id,
    "model": Usage.model,
    "adapter": Usage.adapter_name,
    "key": Usage.key_id,
    "endpoint": Usage.endpoint,
    "batch": Usage.batch_id,  # null: not a batch's line
}


def grouping(group_by: str | Sequence[str] | None, top: int | None = None) -> Grouping:
    """The Grouping of a `group_by` (one name, or day and one other in either order) and a
    `top`; raises UsageQueryError naming the parameter at fault."""
    names = [group_by] if isinstance(group_by, str) else list(group_by or ())
    if any(name not in SUMMARY_GROUPS for name in names):
        raise UsageQueryError("group_by", f"group_by: one of {', '.join(SUMMARY_GROUPS)}")
    if len(names) > 2 or len(set(names)) < len(names) or (len(names) == 2 and "day" not in names):
        raise UsageQueryError(
            "group_by", "group_by: at most two, and then day and one other (day and tenant)"
        )
    name = next((n for n in names if n != "day"), None)
    if top is not None:
        if name is None:
            raise UsageQueryError("top", "top: only with a group_by other than day")
        if not 1 <= top <= MAX_TOP:
            raise UsageQueryError("top", f"top: 1 to {MAX_TOP}")
    return Grouping("day" in names, name, top)


def _sums(columns: Any = Usage.__table__.c) -> list[ColumnElement[Any]]:
    """The sums of the usage rows, or of a subquery's columns of the same names."""
    return [
        func.count().label("num_requests"),
        func.coalesce(func.sum(columns.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(columns.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(columns.completion_tokens), 0).label("completion_tokens"),
    ]


def _bucket(width: int) -> ColumnElement[int]:
    # The width inline, not a bound parameter: PostgreSQL matches a grouped expression to the
    # selected one by its text, and two parameters ($1, $2) would not match.
    width_sql: ColumnElement[int] = literal_column(str(int(width)))
    return Usage.created_epoch - Usage.created_epoch % width_sql


def _inline(epoch: int) -> ColumnElement[int]:
    # A range's bounds inline, not bound parameters: asyncpg prepares every statement, and
    # from the sixth run of one PostgreSQL may switch to a generic plan, which guesses that a
    # range holds a few thousand rows; for bench/console_usage.py's year that plan was 1.6x
    # slower. Inlined, each range is planned for what it covers.
    return literal_column(str(int(epoch)))


def _in_range(query: Select[Any], start: int | None, end: int | None) -> Select[Any]:
    if start is not None:
        query = query.where(Usage.created_epoch >= start)
    if end is not None:
        query = query.where(Usage.created_epoch < end)
    return query


def _day(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).date().isoformat()


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """A summary's parameters (summarize): [start, end) in Unix seconds (None: open), whose
    rows (one tenant's, one batch's lines'; None: every row), the groups and `top`."""

    start: int | None = None
    end: int | None = None
    tenant_id: str | None = None
    batch_id: str | None = None
    group_by: str | Sequence[str] | None = None
    top: int | None = None


async def summarize_usage(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    start: int | None = None,
    end: int | None = None,
    group_by: str | Sequence[str] | None = None,
    top: int | None = None,
) -> list[UsageTotals]:
    """summarize, its parameters by keyword."""
    return await summarize(session, UsageQuery(start, end, tenant_id, None, group_by, top))


async def summarize(session: AsyncSession, query: UsageQuery) -> list[UsageTotals]:
    """Sums over [start, end) (of one tenant's rows, of one batch's lines' rows, if given):
    one row of everything (zeros when nothing matched), or one row per group of `group_by`:
    day, tenant, model, adapter, key, endpoint or batch, or day and one of the others (a row
    per day and group that has requests that day).

    With `top` (1 to MAX_TOP, a grouping other than day): the `top` groups with the most
    tokens (prompt + completion) over the whole range keep their rows; the sums of all the
    others are merged into rows with group None and `other` True (one a day by day). A null
    group (the base model, no key, no endpoint recorded) in the top is an ordinary row.

    Order: days ascending; within a day (or without days), groups by value with null first,
    or with `top`, by their tokens over the range (most first; ties by value, null first),
    then the other row. Raises UsageQueryError for a grouping that cannot be asked."""
    start, end, tenant_id, batch_id = query.start, query.end, query.tenant_id, query.batch_id
    group_by, top = query.group_by, query.top
    how = grouping(group_by, top)
    where = [Usage.created_epoch >= _inline(start)] if start is not None else []
    where += [Usage.created_epoch < _inline(end)] if end is not None else []
    if tenant_id is not None:
        # PostgreSQL refuses a string with a NUL outright; no tenant id holds one: no rows.
        where.append(false() if "\x00" in tenant_id else Usage.tenant_id == tenant_id)
    if batch_id is not None:
        where.append(false() if "\x00" in batch_id else Usage.batch_id == batch_id)
    if how.name is None or how.top is None:
        rows = (await session.execute(_grouped_query(how, where))).all()
        totals = [_totals(row, how, row.grp if how.name else None) for row in rows]
        return sorted(totals, key=lambda t: (t.day or "", t.group is not None, t.group or ""))
    # Two statements, each a pass over the range with a small hash table (the top groups,
    # then the days x (top groups + other)). One statement summing every (day, group) first
    # was slower on bench/console_usage.py's year of a million rows (a day x tenant grid of
    # 180,000 groups outgrows PostgreSQL's default work_mem and spills to disk). Rows written
    # in between land in the sums (as other, if of a new group): the rows still add up to
    # the totals of the range.
    column = GROUP_COLUMNS[how.name]
    tops = await _top_groups(session, column, where, how.top)
    if not tops:
        return []  # no rows in the range
    rows = (await session.execute(_ranked_query(how, column, tops, where))).all()
    totals = [
        _other_totals(row, how) if row.rank is None else _totals(row, how, tops[row.rank])
        for row in rows
    ]
    # Days ascending; within a day the top groups in their rank, the other row last.
    rank = {(False, group): i for i, group in enumerate(tops)}
    return sorted(totals, key=lambda t: (t.day or "", rank.get((t.other, t.group), len(tops))))


def _grouped_query(how: Grouping, where: list[ColumnElement[bool]]) -> Select[Any]:
    keys = ([_bucket(DAY).label("day")] if how.by_day else []) + (
        [GROUP_COLUMNS[how.name].label("grp")] if how.name else []
    )
    return select(*keys, *_sums()).where(*where).group_by(*(key.element for key in keys))


async def _top_groups(
    session: AsyncSession, column: Any, where: list[ColumnElement[bool]], top: int
) -> list[str | None]:
    """The `top` values of `column` with the most tokens over the range, most first; ties by
    value, null first, so that every database picks the same ones."""
    tokens = func.sum(Usage.prompt_tokens + Usage.completion_tokens)
    query = (
        select(column)
        .where(*where)
        .group_by(column)
        .order_by(tokens.desc(), column.is_not(None), column)
        .limit(top)
    )
    return list(await session.scalars(query))


def _ranked_query(
    how: Grouping, column: Any, tops: list[str | None], where: list[ColumnElement[bool]]
) -> Select[Any]:
    """Sums by (day, rank): a row's rank is its group's index in `tops`, null for every other
    group (so they merge). A CASE and not IN: IN never matches a null, and a null group (the
    base model, no key) may be in the top."""
    rank = case(
        *(
            (column.is_(None) if value is None else column == value, i)
            for i, value in enumerate(tops)
        )
    )
    day = [_bucket(DAY).label("day")] if how.by_day else []
    ranked = (
        select(
            *day,
            rank.label("rank"),
            Usage.prompt_tokens,
            Usage.cached_tokens,
            Usage.completion_tokens,
        )
        .where(*where)
        .subquery("ranked")
    )
    # Grouped by the subquery's columns: PostgreSQL would not match a grouped expression with
    # bound parameters to the selected one.
    keys = ([ranked.c.day] if how.by_day else []) + [ranked.c.rank]
    return select(*keys, *_sums(ranked.c)).group_by(*keys)


def _totals(row: Any, how: Grouping, group: str | None) -> UsageTotals:
    day = _day(int(row.day)) if how.by_day else None
    return UsageTotals(
        group if how.name else day,
        int(row.num_requests),
        int(row.prompt_tokens),
        int(row.cached_tokens),
        int(row.completion_tokens),
        day=day,
    )


def _other_totals(row: Any, how: Grouping) -> UsageTotals:
    """The sums of every group outside the top (in a day, by day)."""
    return replace(_totals(row, how, None), other=True)


async def tokens_used(session: AsyncSession, *, tenant_id: str, since: datetime) -> int:
    """Prompt and completion tokens the tenant's requests used since `since` (a quota's
    start)."""
    query = select(func.coalesce(func.sum(Usage.prompt_tokens + Usage.completion_tokens), 0)).where(
        Usage.tenant_id == tenant_id, Usage.created_epoch >= int(since.timestamp())
    )
    used: Any = await session.scalar(query)
    return int(used or 0)


def month_range(now: int) -> tuple[int, int]:
    """The UTC calendar month of `now` (Unix seconds) as [start, end) in Unix seconds."""
    at = datetime.fromtimestamp(now, UTC)
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    end = datetime(at.year + at.month // 12, at.month % 12 + 1, 1, tzinfo=UTC)
    return int(start.timestamp()), int(end.timestamp())


async def month_tokens(
    session: AsyncSession, *, tenant_ids: Sequence[str], now: int | None = None
) -> dict[str, int]:
    """Prompt + completion tokens of each tenant in the UTC calendar month of `now` (default:
    now), 0 for a tenant without requests: one grouped query for them all."""
    if not tenant_ids:
        return {}
    first, stop = month_range(int(datetime.now(UTC).timestamp()) if now is None else now)
    tokens = func.sum(Usage.prompt_tokens + Usage.completion_tokens)
    query = (
        select(Usage.tenant_id, tokens.label("tokens"))
        .where(Usage.created_epoch >= first, Usage.created_epoch < stop)
        .group_by(Usage.tenant_id)
    )
    if len(tenant_ids) <= MAX_TENANTS_IN:
        query = query.where(Usage.tenant_id.in_(list(tenant_ids)))
    found = {row.tenant_id: int(row.tokens) for row in await session.execute(query)}
    return {tenant_id: found.get(tenant_id, 0) for tenant_id in tenant_ids}


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


@dataclass(frozen=True, slots=True)
class CompletionsQuery:
    """A completions_page's parameters, OpenAI's: buckets of `bucket_width` from start_time to
    end_time (None: now), grouped by COMPLETION_GROUPS, narrowed to tenants (projects), keys
    and models (empty: all); `page` a next_page of the same query."""

    start_time: int
    end_time: int | None = None
    bucket_width: str = "1d"
    group_by: Sequence[str] = ()
    limit: int | None = None
    page: str | None = None
    tenant_ids: Sequence[str] = ()
    api_key_ids: Sequence[str] = ()
    models: Sequence[str] = ()


async def completions_page(
    session: AsyncSession, query: CompletionsQuery, *, now: int | None = None
) -> dict[str, Any]:
    """One page of buckets from start_time (snapped down to its minute, hour or day) to
    end_time (exclusive; default now), every bucket listed, empty ones too. Raises
    UsageQueryError for parameters out of bounds."""
    start_time, end_time, group_by = query.start_time, query.end_time, query.group_by
    width, limit = _width_and_limit(query.bucket_width, query.limit)
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
    if query.page is not None:
        cursor = decode_page(query.page)
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
    sums: Select[Any] = select(*keys, *_sums())
    sums = sums.group_by(bucket, *(columns[g] for g in groups))
    sums = _in_range(sums, max(start_time, first), min(end, stop))
    for column, values in (
        (Usage.tenant_id, query.tenant_ids),
        (Usage.key_id, query.api_key_ids),
        (Usage.model, query.models),
    ):
        if values:
            sums = sums.where(column.in_(list(values)))
    results: dict[int, list[dict[str, Any]]] = {first + i * width: [] for i in range(count)}
    if count:
        for row in (await session.execute(sums)).all():
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
