"""The Redis limiter: one set of counters for every gateway replica.

Every decision is taken inside Redis by one Lua script (scripts.py) on Redis's clock; this
process keeps no counters of its own, so N replicas admit a tenant's limit, not N times it
(LiteLLM's #40291: local reads, Redis writes). acquire is one EVALSHA; release is one.

When Redis does not answer within `timeout` (connect or read), the failure mode decides:
"open" serves from an in-process LocalLimiter (same limits, per process) and tries Redis
again at most once per `probe_interval`, with one request, until it answers; "closed"
refuses with LimiterUnavailable (HTTP 503) and probes the same way. One warning per outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.tenancy.ratelimit.buckets import Month, Snapshot, judge, month_of
from gateway.tenancy.ratelimit.limits import (
    BACKEND_LOCAL,
    BACKEND_NONE,
    BACKEND_REDIS,
    UNLIMITED,
    LimiterOptions,
    LimiterUnavailable,
    RateLimited,
    RateLimiter,
    RateState,
    Reservation,
    TenantLimits,
    check_tokens,
)
from gateway.tenancy.ratelimit.local import LocalLimiter, QuotaUsed, ledger_used
from gateway.tenancy.ratelimit.pipeline import AutoPipeline
from gateway.tenancy.ratelimit.scripts import ACQUIRE, RELEASE

logger = logging.getLogger(__name__)

# What "Redis does not answer" is: refused or reset connections, timeouts, and errors it
# answers with (a full memory, a busy script) - none is the tenant's fault.
REDIS_DOWN = (RedisError, OSError, asyncio.TimeoutError)


class RedisLimiter(RateLimiter):
    def __init__(
        self,
        url: str,
        options: LimiterOptions | None = None,
        *,
        quota_used: QuotaUsed | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        options = options or LimiterOptions()
        # No retries: a retry multiplies the timeout on the request path, and the failure
        # mode is the answer to a Redis that does not answer.
        self.redis = Redis.from_url(
            url,
            socket_timeout=options.timeout,
            socket_connect_timeout=options.timeout,
            retry=Retry(NoBackoff(), 0),
        )
        self.failure_mode = options.failure_mode
        self.quota_used = quota_used
        self.key_prefix = options.key_prefix
        self.lease = options.concurrency_lease
        self.clock = clock  # only for the calendar month; buckets run on Redis's TIME
        self.probe_interval = options.probe_interval
        self.fallback = LocalLimiter(
            quota_used=quota_used,
            concurrency_lease=options.concurrency_lease,
            clock=clock,
            failure_mode=options.failure_mode,
        )
        self._acquire = self.redis.register_script(ACQUIRE)
        self._release = self.redis.register_script(RELEASE)
        self.pipeline = AutoPipeline(self.redis)
        self._num_refused = 0
        self.num_redis_errors = 0
        self.num_fallback = 0  # acquires the local fallback answered
        self.num_dropped_releases = 0  # releases of Redis reservations while it was down
        self._down = False
        self._probe_at = 0.0  # time.monotonic() of the next try during an outage
        self._probing = False
        self._seeding: dict[tuple[str, str], asyncio.Future[int | None]] = {}

    @property
    def num_refused(self) -> int:
        return self._num_refused + self.fallback.num_refused

    @property
    def using_fallback(self) -> bool:
        """Redis does not answer and requests are served by the in-process limiter."""
        return self._down and self.failure_mode == "open"

    def keys(self, tenant_id: str, month: str = "") -> list[str]:
        # One hash tag per tenant: a script's keys share a Redis Cluster slot.
        base = f"{self.key_prefix}:{{{tenant_id}}}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:inflight", f"{base}:month:{month}"]

    async def acquire(
        self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int
    ) -> tuple[Reservation, RateState]:
        check_tokens(tokens)
        if limits.unlimited:
            return Reservation(tenant_id, request_id, tokens, limits, BACKEND_NONE), UNLIMITED
        probe = self._down
        if not self._try_redis():
            return await self._without_redis(tenant_id, request_id, limits, tokens)
        month = None if limits.monthly_tokens is None else month_of(self.clock())
        seed = -1 if self.quota_used is not None else 0
        try:
            raw = await self._run_acquire(tenant_id, request_id, limits, tokens, month, seed)
            if raw[0] == b"seed":
                assert month is not None
                used = await self._seed(tenant_id, month)
                if used is None and self.failure_mode == "closed":
                    raise LimiterUnavailable("the usage ledger does not answer", 1.0)
                if used is None:
                    month, used = None, 0  # open: no quota this time, the next one retries
                raw = await self._run_acquire(tenant_id, request_id, limits, tokens, month, used)
        except REDIS_DOWN as exc:
            self._failed(exc)
            return await self._without_redis(tenant_id, request_id, limits, tokens)
        finally:
            if probe:
                self._probing = False
        self._answered()
        return self._verdict(tenant_id, request_id, limits, tokens, month, raw)

    async def in_flight(self, tenant_id: str) -> int:
        """Counted in Redis (every replica's requests), or in process while it is down."""
        if self._down:
            return await self.fallback.in_flight(tenant_id)
        seconds, micros = await self.redis.time()
        return int(
            await self.redis.zcount(self.keys(tenant_id)[2], f"({seconds}.{micros:06d}", "+inf")
        )

    async def release(self, reservation: Reservation, used_tokens: int) -> None:
        if reservation.backend == BACKEND_LOCAL:
            await self.fallback.release(reservation, used_tokens)
            return
        if reservation.backend != BACKEND_REDIS or not reservation.tracked:
            return
        if self._down:
            # Not worth a timeout: the lease expiry frees the slot; the tpm refund and the
            # quota correction are lost (the usage ledger still has the real count).
            self.num_dropped_releases += 1
            logger.info("Redis is down: dropped the release of %s", reservation.request_id)
            return
        tpm = reservation.limits.tpm
        month = reservation.month or ""
        _, tpm_key, inflight_key, month_key = self.keys(reservation.tenant_id, month)
        args = (
            reservation.request_id,
            -1 if tpm is None else tpm,
            reservation.tokens - used_tokens,
            1 if reservation.month is not None else 0,
        )
        try:
            # Shielded: a release awaited by a task being cancelled still goes out.
            keys = [tpm_key, inflight_key, month_key]
            await asyncio.shield(self.pipeline.run(self._release, keys, args))
        except REDIS_DOWN as exc:
            self._failed(exc)
            self.num_dropped_releases += 1
            logger.info("dropped the release of %s: %s", reservation.request_id, exc)
        except Exception:  # noqa: BLE001 - a release must never fail the request it ends
            logger.exception("could not release %s", reservation.request_id)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.fallback.close()

    async def _run_acquire(
        self,
        tenant_id: str,
        request_id: str,
        limits: TenantLimits,
        tokens: int,
        month: Month | None,
        seed: int,
    ) -> list[Any]:
        keys = self.keys(tenant_id, "" if month is None else month.key)
        quota = -1 if month is None or limits.monthly_tokens is None else limits.monthly_tokens
        args = (
            _limit(limits.rpm),
            _limit(limits.tpm),
            tokens,
            _limit(limits.max_concurrency),
            request_id,
            self.lease,
            quota,
            seed,
            0 if month is None else month.expire_at,
        )
        raw: list[Any] = await self.pipeline.run(self._acquire, keys, args)
        return raw

    def _verdict(
        self,
        tenant_id: str,
        request_id: str,
        limits: TenantLimits,
        tokens: int,
        month: Month | None,
        raw: list[Any],
    ) -> tuple[Reservation, RateState]:
        admitted, rpm_level, tpm_level, in_flight, lease_wait, used = raw
        snap = Snapshot(
            rpm_level=float(rpm_level) if rpm_level else None,
            tpm_level=float(tpm_level) if tpm_level else None,
            in_flight=None if in_flight < 0 else in_flight,
            lease_wait=float(lease_wait),
            month_used=None if used < 0 else used,
        )
        month_reset = 0.0 if month is None else month.end.timestamp() - self.clock()
        state, refused = judge(limits, tokens, snap, month_reset)
        if admitted:
            charged = None if month is None else month.key
            return Reservation(tenant_id, request_id, tokens, limits, BACKEND_REDIS, charged), state
        self._num_refused += 1
        if refused is None:  # the script and judge() share one rule; this is a safety net
            refused = RateLimited("rate_limit_exceeded", "rpm", "Rate limit reached.", 1.0, state)
        raise refused

    async def _seed(self, tenant_id: str, month: Month) -> int | None:
        """The ledger's count for a month whose Redis counter does not exist yet; concurrent
        first requests of a tenant share one query."""
        key = (tenant_id, month.key)
        future = self._seeding.get(key)
        if future is None:
            future = asyncio.ensure_future(ledger_used(self.quota_used, tenant_id, month))
            self._seeding[key] = future
            future.add_done_callback(lambda _: self._seeding.pop(key, None))
        return await asyncio.shield(future)

    def _try_redis(self) -> bool:
        """Whether this request goes to Redis: always, unless in an outage, where one
        request per probe interval does."""
        if not self._down:
            return True
        if self._probing or time.monotonic() < self._probe_at:
            return False
        self._probing = True
        return True

    def _failed(self, exc: BaseException) -> None:
        self.num_redis_errors += 1
        self._probe_at = time.monotonic() + self.probe_interval
        if self._down:
            return
        self._down = True
        then = (
            "limits are per process until it answers"
            if self.failure_mode == "open"
            else "requests are refused (503) until it answers"
        )
        logger.warning("Redis does not answer (%s: %s): %s", type(exc).__name__, exc, then)

    def _answered(self) -> None:
        if self._down:
            self._down = False
            logger.warning("Redis answers again: limits are shared again")

    async def _without_redis(
        self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int
    ) -> tuple[Reservation, RateState]:
        if self.failure_mode == "closed":
            retry = max(0.001, self._probe_at - time.monotonic())
            raise LimiterUnavailable("the rate limiter's Redis does not answer", retry)
        self.num_fallback += 1
        return await self.fallback.acquire(tenant_id, request_id, limits, tokens)


def _limit(value: int | None) -> int:
    return -1 if value is None else value
