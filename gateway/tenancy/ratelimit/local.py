"""The in-process limiter: the same semantics as the Redis one, for one process.

asyncio-safe without locks: the check and the reservation run with no await between them.
The only await, fetching a month's quota counter from the usage ledger, happens before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

from gateway.tenancy.ratelimit.buckets import Month, Snapshot, judge, level, month_of, take
from gateway.tenancy.ratelimit.limits import (
    BACKEND_LOCAL,
    BACKEND_NONE,
    UNLIMITED,
    FailureMode,
    LimiterUnavailable,
    RateLimiter,
    RateState,
    Reservation,
    TenantLimits,
    check_tokens,
)

logger = logging.getLogger(__name__)

QuotaUsed = Callable[[str, datetime], Awaitable[int]]
SWEEP_INTERVAL = 60.0  # seconds between sweeps of idle tenants and past months


@dataclass(slots=True)
class _Tenant:
    rpm_tat: float = 0.0  # bucket full at this time (buckets.py)
    tpm_tat: float = 0.0
    # request id -> lease expiry. An entry stays one lease past its expiry (not counted),
    # so a release that comes late still finds it and refunds.
    in_flight: dict[str, float] = field(default_factory=dict)


class LocalLimiter(RateLimiter):
    def __init__(
        self,
        *,
        quota_used: QuotaUsed | None = None,
        concurrency_lease: float = 600.0,
        clock: Callable[[], float] = time.time,
        failure_mode: FailureMode = "open",
    ) -> None:
        self.quota_used = quota_used
        self.lease = concurrency_lease
        self.clock = clock
        self.failure_mode = failure_mode
        self._num_refused = 0
        self._tenants: dict[str, _Tenant] = {}
        self._months: dict[tuple[str, str], int] = {}  # (tenant, "2025-01") -> tokens used
        self._seeding: dict[tuple[str, str], asyncio.Future[int | None]] = {}
        self._next_sweep = clock() + SWEEP_INTERVAL

    @property
    def num_refused(self) -> int:
        return self._num_refused

    async def acquire(
        self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int
    ) -> tuple[Reservation, RateState]:
        check_tokens(tokens)
        if limits.unlimited:
            return Reservation(tenant_id, request_id, tokens, limits, BACKEND_NONE), UNLIMITED
        month = None
        if limits.monthly_tokens is not None:
            month = month_of(self.clock())
            if (tenant_id, month.key) not in self._months and not await self._seed(
                tenant_id, month
            ):
                month = None  # the ledger failed and the mode is open: no quota this time
        return self.reserve(tenant_id, request_id, limits, tokens, month)

    def reserve(
        self,
        tenant_id: str,
        request_id: str,
        limits: TenantLimits,
        tokens: int,
        month: Month | None,
    ) -> tuple[Reservation, RateState]:
        """Check and reserve, synchronously (no await: atomic under asyncio)."""
        now = self.clock()
        if now >= self._next_sweep:
            self._sweep(now)
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            tenant = self._tenants[tenant_id] = _Tenant()
        in_flight, lease_wait = None, 0.0
        if limits.max_concurrency is not None:
            live = [expiry for expiry in tenant.in_flight.values() if expiry > now]
            in_flight = len(live)
            lease_wait = min(live, default=now) - now
        month_used = None if month is None else self._months.get((tenant_id, month.key))
        snap = Snapshot(
            rpm_level=None if limits.rpm is None else level(tenant.rpm_tat, now, limits.rpm),
            tpm_level=None if limits.tpm is None else level(tenant.tpm_tat, now, limits.tpm),
            in_flight=in_flight,
            lease_wait=lease_wait,
            month_used=month_used,
        )
        month_reset = 0.0 if month is None else month.end.timestamp() - now
        state, refused = judge(limits, tokens, snap, month_reset)
        if refused is not None:
            self._num_refused += 1
            raise refused
        if limits.rpm is not None:
            tenant.rpm_tat = take(tenant.rpm_tat, now, limits.rpm, 1)
        if limits.tpm is not None:
            tenant.tpm_tat = take(tenant.tpm_tat, now, limits.tpm, tokens)
        charged = None
        if month is not None and month_used is not None:
            self._months[(tenant_id, month.key)] = month_used + tokens
            charged = month.key
        reservation = Reservation(tenant_id, request_id, tokens, limits, BACKEND_LOCAL, charged)
        if reservation.tracked:
            self._expire_leases(tenant, now)
            tenant.in_flight[request_id] = now + self.lease
        return reservation, state

    async def release(self, reservation: Reservation, used_tokens: int) -> None:
        try:
            self.give_back(reservation, used_tokens)
        except Exception:  # noqa: BLE001 - a release must never fail the request it ends
            logger.exception("could not release %s", reservation.request_id)

    def give_back(self, reservation: Reservation, used_tokens: int) -> None:
        if not reservation.tracked:
            return
        tenant = self._tenants.get(reservation.tenant_id)
        if tenant is None or tenant.in_flight.pop(reservation.request_id, None) is None:
            return  # released already (or a lease ago and swept)
        back = reservation.tokens - used_tokens
        cap = reservation.limits.tpm
        if cap is not None and back:
            tenant.tpm_tat = take(tenant.tpm_tat, self.clock(), cap, -back)
        if reservation.month is not None and back:
            key = (reservation.tenant_id, reservation.month)
            if key in self._months:
                self._months[key] = max(0, self._months[key] - back)

    async def in_flight(self, tenant_id: str) -> int:
        tenant = self._tenants.get(tenant_id)
        now = self.clock()
        return 0 if tenant is None else sum(1 for e in tenant.in_flight.values() if e > now)

    async def close(self) -> None:
        self._tenants.clear()
        self._months.clear()

    async def _seed(self, tenant_id: str, month: Month) -> bool:
        """Start the month's counter from what the usage ledger says was used, once per
        tenant and month (concurrent first requests share one query). False when the ledger
        failed and the mode is open; LimiterUnavailable when it is closed."""
        key = (tenant_id, month.key)
        future = self._seeding.get(key)
        if future is None:
            future = asyncio.ensure_future(ledger_used(self.quota_used, tenant_id, month))
            self._seeding[key] = future
            future.add_done_callback(lambda _: self._seeding.pop(key, None))
        used = await asyncio.shield(future)
        if used is None:
            if self.failure_mode == "closed":
                raise LimiterUnavailable("the usage ledger does not answer", retry_after=1.0)
            return False
        self._months.setdefault(key, used)
        return True

    def _expire_leases(self, tenant: _Tenant, now: float) -> None:
        gone = now - self.lease
        for request_id in [r for r, expiry in tenant.in_flight.items() if expiry <= gone]:
            del tenant.in_flight[request_id]

    def _sweep(self, now: float) -> None:
        """Forget full buckets of tenants with nothing in flight, and past months' counters
        (their releases, a grace later, find nothing to correct)."""
        self._next_sweep = now + SWEEP_INTERVAL
        for tenant_id, tenant in list(self._tenants.items()):
            self._expire_leases(tenant, now)
            if not tenant.in_flight and tenant.rpm_tat <= now and tenant.tpm_tat <= now:
                del self._tenants[tenant_id]
        current = month_of(now).key
        for key in [k for k in self._months if k[1] != current]:
            del self._months[key]


async def ledger_used(quota_used: QuotaUsed | None, tenant_id: str, month: Month) -> int | None:
    """Tokens the usage ledger counts for the tenant since the month began; 0 without a
    ledger, None (logged) when it fails."""
    if quota_used is None:
        return 0
    try:
        return int(await quota_used(tenant_id, month.start))
    except Exception:  # noqa: BLE001 - the caller decides by its failure mode
        logger.warning(
            "could not read %s's usage for %s from the ledger", tenant_id, month.key, exc_info=True
        )
        return None
