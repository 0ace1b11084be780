"""The math both limiters share: token buckets, the calendar month, and the verdict.

A bucket of capacity `cap` refills continuously at cap/60 per second. It is stored as one
number, `tat`: the time at which it will be full again (GCRA's "theoretical arrival time").
A bucket with tat <= now is full, so a missing entry (a Redis key that expired at tat) is a
full bucket and an idle tenant costs nothing:

    level(now) = cap - max(0, tat - now) * cap / 60
    take n:      tat = max(tat, now) + n * 60 / cap
    give n back: tat = max(tat, now) - n * 60 / cap      (full once it is <= now)

A level below zero is debt: a request that used more than it reserved. The Lua scripts
(scripts.py) carry the same formulas and the same fit rule (`fits`); the verdict, the
messages and the state are built here from what either store saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gateway.tenancy.ratelimit.limits import RateLimited, RateState, TenantLimits, format_duration

# Float slack in the fit rule: N takes of 60/N seconds from a bucket of N must leave a level
# of exactly 0, not -1e-13 that refuses the last one.
EPSILON = 1e-6
# The retry a concurrency refusal suggests, at most: a slot frees when any in-flight request
# of the tenant finishes, which nothing here can predict (a completion takes seconds); one
# second polls without flooding. The earliest lease expiry bounds it when it is sooner.
CONCURRENCY_RETRY = 1.0
# A month's quota counter outlives the month by this much, so a request that started in it
# and ends after it still corrects it.
MONTH_GRACE = timedelta(days=7)


def level(tat: float, now: float, cap: int) -> float:
    return cap - max(0.0, tat - now) * cap / 60.0


def take(tat: float, now: float, cap: int, n: float) -> float:
    """The bucket's new tat after taking n (a negative n gives back; <= now is full)."""
    return max(tat, now) + n * 60.0 / cap


def fits(level: float, need: float) -> bool:
    return level + EPSILON >= need


def wait(level: float, need: float, cap: int) -> float:
    """Seconds until the bucket holds `need`."""
    return 0.0 if fits(level, need) else (need - level) * 60.0 / cap


def until_full(level: float, cap: int) -> float:
    return max(0.0, (cap - level) * 60.0 / cap)


def whole(level: float) -> int:
    return max(0, math.floor(level + EPSILON))


@dataclass(frozen=True, slots=True)
class Month:
    """A UTC calendar month: its counter key, its start (what the usage ledger is asked
    from), the next month's start and when its counter may expire."""

    key: str
    start: datetime
    end: datetime

    @property
    def expire_at(self) -> int:
        return int((self.end + MONTH_GRACE).timestamp())


def month_of(now: float) -> Month:
    at = datetime.fromtimestamp(now, UTC)
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    end = datetime(at.year + at.month // 12, at.month % 12 + 1, 1, tzinfo=UTC)
    return Month(f"{at.year:04d}-{at.month:02d}", start, end)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The limits' state as the check saw it, before the request; None where unlimited."""

    rpm_level: float | None = None
    tpm_level: float | None = None
    in_flight: int | None = None  # unexpired leases
    lease_wait: float = 0.0  # seconds until the earliest of them expires
    month_used: int | None = None


def judge(
    limits: TenantLimits, tokens: int, snap: Snapshot, month_reset: float
) -> tuple[RateState, RateLimited | None]:
    """The request's verdict: the state after it when it fits every limit, else the state
    before it and the refusal of the limit that binds longest (`month_reset`: seconds until
    the next month)."""
    refusal = _refusal(limits, tokens, snap, month_reset)
    if refusal is not None:
        return refusal.state, refusal
    rpm = None if snap.rpm_level is None else snap.rpm_level - 1
    tpm = None if snap.tpm_level is None else snap.tpm_level - tokens
    return _state(limits, rpm, tpm), None


def _state(limits: TenantLimits, rpm: float | None, tpm: float | None) -> RateState:
    requests: tuple[int | None, int | None, float | None] = (None, None, None)
    token_trio: tuple[int | None, int | None, float | None] = (None, None, None)
    if limits.rpm is not None and rpm is not None:
        requests = (limits.rpm, whole(rpm), until_full(rpm, limits.rpm))
    if limits.tpm is not None and tpm is not None:
        token_trio = (limits.tpm, whole(tpm), until_full(tpm, limits.tpm))
    return RateState(*requests, *token_trio)


def _refusal(
    limits: TenantLimits, tokens: int, snap: Snapshot, month_reset: float
) -> RateLimited | None:
    state = _state(limits, snap.rpm_level, snap.tpm_level)
    quota, used = limits.monthly_tokens, snap.month_used
    if quota is not None and used is not None and used >= quota:
        message = (
            f"You exceeded your current quota, please check your plan and billing details: "
            f"monthly token quota {quota}, used {used} this month. It renews in "
            f"{format_duration(month_reset)}."
        )
        return RateLimited("insufficient_quota", "monthly_tokens", message, month_reset, state)
    if limits.tpm is not None and tokens > limits.tpm:
        assert snap.tpm_level is not None
        message = (
            f"Request too large for tokens per minute (tpm): Limit {limits.tpm}, Requested "
            f"{tokens}. The input or output tokens must be reduced (lower max_tokens) in "
            f"order to run successfully."
        )
        retry = until_full(snap.tpm_level, limits.tpm)
        return RateLimited("rate_limit_exceeded", "tpm", message, retry, state)
    # Every limit that does not fit, with its wait; the longest binds.
    binding: list[tuple[float, str, str]] = []
    for name, label, cap, lvl, need in (
        ("rpm", "requests per minute (rpm)", limits.rpm, snap.rpm_level, 1),
        ("tpm", "tokens per minute (tpm)", limits.tpm, snap.tpm_level, tokens),
    ):
        if cap is None or lvl is None or fits(lvl, need):
            continue
        retry = wait(lvl, need, cap)
        message = (
            f"Rate limit reached for {label}: Limit {cap}, Used {cap - whole(lvl)}, "
            f"Requested {need}. Please try again in {format_duration(retry)}."
        )
        binding.append((retry, name, message))
    conc, in_flight = limits.max_concurrency, snap.in_flight
    if conc is not None and in_flight is not None and in_flight >= conc:
        retry = min(CONCURRENCY_RETRY, max(snap.lease_wait, 0.001))
        message = (
            f"Rate limit reached for concurrent requests: Limit {conc}, In flight "
            f"{in_flight}. Please try again in {format_duration(retry)}."
        )
        binding.append((retry, "concurrency", message))
    if not binding:
        return None
    retry, name, message = max(binding)
    return RateLimited("rate_limit_exceeded", name, message, retry, state)
