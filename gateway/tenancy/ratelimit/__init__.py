"""Per-tenant rate limits and quotas: rpm, tpm, concurrent requests and monthly tokens.

`make_limiter` picks the store: Redis when a URL is configured (counters shared by every
gateway replica, each check one Lua script), else this process. The gateway calls
`acquire` before a request runs (RateLimited -> 429 with `retry_after` and the state's
`x-ratelimit-*` headers; LimiterUnavailable -> 503) and `release` when it ends, however it
ends, with the tokens it really used.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.tenancy.ratelimit.limits import (
    FailureMode,
    LimiterOptions,
    LimiterUnavailable,
    RateLimited,
    RateLimiter,
    RateState,
    Reservation,
    TenantLimits,
    format_duration,
)
from gateway.tenancy.ratelimit.local import LocalLimiter, QuotaUsed
from gateway.tenancy.ratelimit.redis_limiter import RedisLimiter

__all__ = [
    "FailureMode",
    "LimiterOptions",
    "LimiterUnavailable",
    "LocalLimiter",
    "RateLimited",
    "RateLimiter",
    "RateState",
    "RedisLimiter",
    "Reservation",
    "TenantLimits",
    "format_duration",
    "make_limiter",
]


def make_limiter(
    redis_url: str | None,
    options: LimiterOptions | None = None,
    *,
    quota_used: QuotaUsed | None = None,
    clock: Callable[[], float] = time.time,
) -> RateLimiter:
    """A RedisLimiter on `redis_url`, or a LocalLimiter without one. `quota_used(tenant_id,
    month_start)` is the usage ledger's token count for the month so far (a month's counter
    starts from it); `clock` is epoch seconds (the local limiter's time, the calendar month
    for both)."""
    options = options or LimiterOptions()
    if redis_url is None:
        return LocalLimiter(
            quota_used=quota_used,
            concurrency_lease=options.concurrency_lease,
            clock=clock,
            failure_mode=options.failure_mode,
        )
    return RedisLimiter(redis_url, options, quota_used=quota_used, clock=clock)
