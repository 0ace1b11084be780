"""The limiter's values and interface: a tenant's limits, the state OpenAI's `x-ratelimit-*`
headers report, a reservation to release, the two refusals, a limiter's options, and
`RateLimiter`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

# Where a reservation lives, so release() goes back to the store that made it.
BACKEND_NONE = "none"  # nothing was reserved (a tenant without limits)
BACKEND_LOCAL = "local"
BACKEND_REDIS = "redis"

# What a limiter does when its store (Redis, or the usage ledger for a month's quota) does not
# answer: "open" admits (from a local limiter), "closed" refuses with LimiterUnavailable.
FailureMode = Literal["open", "closed"]


@dataclass(frozen=True, slots=True)
class LimiterOptions:
    """A limiter's settings (`--redis-*`, `--concurrency-lease`). `failure_mode` and
    `concurrency_lease` (seconds a concurrency slot is held by a holder that never gave it
    back) are every limiter's; the rest the Redis one's: its keys' prefix, the `timeout` of
    its connects and reads and the `probe_interval` of its tries during an outage (seconds)."""

    failure_mode: FailureMode = "open"
    key_prefix: str = "loragate"
    concurrency_lease: float = 600.0
    timeout: float = 0.25
    probe_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.failure_mode not in ("open", "closed"):
            raise ValueError(f"failure_mode must be 'open' or 'closed', not {self.failure_mode!r}")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits; None is unlimited. rpm and tpm are token buckets of that capacity
    refilled continuously at limit/60 per second; monthly_tokens is the quota of tokens per
    UTC calendar month."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    monthly_tokens: int | None = None

    def __post_init__(self) -> None:
        # A bucket of capacity 0 never refills (a rate of 0/60 per second): refuse it here
        # rather than divide by it later. Concurrency 0 and quota 0 are meaningful refusals.
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 or None (unlimited), not {value}")
        for name in ("max_concurrency", "monthly_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be at least 0 or None (unlimited), not {value}")

    @property
    def unlimited(self) -> bool:
        return (
            self.rpm is None
            and self.tpm is None
            and self.max_concurrency is None
            and self.monthly_tokens is None
        )


@dataclass(frozen=True, slots=True)
class RateState:
    """The request and token buckets after this request (before it, for a refusal), as
    OpenAI's `x-ratelimit-*` headers state them: remaining is whole units, reset is seconds
    until the bucket is full again."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None

    def headers(self) -> dict[str, str]:
        """The six `x-ratelimit-*` headers; a limit's trio is left out when it is unlimited."""
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens),
        ):
            if limit is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(remaining or 0)
            out[f"x-ratelimit-reset-{kind}"] = format_duration(reset or 0.0)
        return out


UNLIMITED = RateState()


@dataclass(frozen=True, slots=True)
class Reservation:
    """What acquire() took, for release(). `request_id` must be unique per acquire: it names
    the concurrency slot and makes release idempotent."""

    tenant_id: str
    request_id: str
    tokens: int
    limits: TenantLimits
    backend: str = BACKEND_NONE
    # The month ("2025-01") whose quota counter this request was charged to, or None: the
    # release corrects that month's counter even after the month has turned.
    month: str | None = None

    @property
    def tracked(self) -> bool:
        """Whether release() has anything to give back: an in-flight entry is recorded for
        every reservation that holds tokens, a slot or a quota charge (rpm takes nothing
        back)."""
        return self.backend != BACKEND_NONE and (
            self.limits.tpm is not None
            or self.limits.max_concurrency is not None
            or self.month is not None
        )


class RateLimited(Exception):
    """A refusal (HTTP 429). `code` is OpenAI's: "rate_limit_exceeded" for rpm, tpm and
    concurrency, "insufficient_quota" for the monthly quota; `limit` names which ("rpm",
    "tpm", "concurrency", "monthly_tokens"); `retry_after` is the seconds until the request
    could pass."""

    def __init__(
        self, code: str, limit: str, message: str, retry_after: float, state: RateState
    ) -> None:
        super().__init__(message)
        self.code = code
        self.limit = limit
        self.message = message
        self.retry_after = retry_after
        self.state = state


class LimiterUnavailable(Exception):
    """The shared store does not answer and the failure mode is "closed" (HTTP 503)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class RateLimiter(ABC):
    """Per-tenant rpm, tpm, concurrency and monthly quota, checked and reserved at once."""

    @property
    @abstractmethod
    def num_refused(self) -> int:
        """Acquires refused so far (the metrics' rate-limited count)."""

    @abstractmethod
    async def acquire(
        self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int
    ) -> tuple[Reservation, RateState]:
        """One atomic check-and-reserve of all four limits: one request of rpm, `tokens`
        (prompt + max_tokens) of tpm, a concurrency slot, and a monthly quota not yet spent
        (the reservation is added to it). All or nothing: a refusal (RateLimited) reserves
        nothing."""

    @abstractmethod
    async def release(self, reservation: Reservation, used_tokens: int) -> None:
        """Give back what the request did not use: tpm is refunded to the actual count, the
        concurrency slot is freed, the month's counter is corrected to actual usage. Never
        raises; a second release of the same reservation does nothing."""

    @abstractmethod
    async def in_flight(self, tenant_id: str) -> int:
        """The tenant's requests holding a concurrency slot now (for operators and tests)."""

    @abstractmethod
    async def close(self) -> None: ...


def check_tokens(tokens: int) -> None:
    if tokens < 0:
        raise ValueError(f"a request reserves 0 tokens or more, not {tokens}")


def format_duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format at millisecond resolution, rounded up so a wait that
    is not over never reads 0: "20ms", "1s", "17.28s", "6m0s", "1h0m0s"."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, frac = divmod(rest, 1000)
    text = f"{secs}.{frac:03d}".rstrip("0") if frac else str(secs)
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"
