"""A tenant's request past its limits: the limiter's answer as HTTP, and the reservation that
must be handed back however the request ends.

`Admission.admit` runs the limiter's one check-and-reserve (requests per minute, tokens per
minute, concurrency, monthly quota) and answers a refusal with OpenAI's 429 (`Retry-After`:
seconds until the slot frees) or, with Redis down and --redis-failure-mode closed, a 503.
The `Ticket` it returns is released exactly once: with the tokens the request used, or none.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

from gateway.http.errors import APIError
from gateway.metrics import TenantMetrics
from gateway.tenancy.auth import RequestTenant
from gateway.tenancy.ratelimit import (
    LimiterUnavailable,
    RateLimited,
    RateLimiter,
    RateState,
    Reservation,
    TenantLimits,
)

logger = logging.getLogger(__name__)

# OpenAI's error type for a rate limit names the dimension that ran out.
_TYPES = {"tpm": "tokens", "monthly_tokens": "insufficient_quota"}


@dataclass(slots=True)
class Ticket:
    """An admitted request's reservation; `release` hands it back once (later calls do
    nothing), in the background: neither a response nor a cancelled stream waits for the
    limiter's round trip."""

    limiter: RateLimiter
    reservation: Reservation
    state: RateState
    # Releases under way, held so that they are not collected before they finish: the
    # Admission's own set, shared by its tickets.
    pending: set[asyncio.Task[None]] = field(default_factory=set)
    released: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return self.state.headers()

    def release(self, used_tokens: int) -> None:
        if not self.released:
            self.released = True
            task = asyncio.get_running_loop().create_task(
                self.limiter.release(self.reservation, used_tokens)
            )
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)


class Admission:
    def __init__(self, limiter: RateLimiter, metrics: TenantMetrics) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.releasing: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: RequestTenant, request_id: str, tokens: int) -> Ticket:
        """Reserve one request and `tokens` tokens for the tenant, or raise APIError 429/503."""
        return await self._acquire(tenant, request_id, tenant.limits, tokens)

    async def admit_quota(self, tenant: RequestTenant, request_id: str, tokens: int) -> Ticket:
        """A batch line's admission: only the tenant's monthly token quota is checked and
        charged (its rpm, tpm and concurrency are its interactive traffic's, which batches
        never take). Raises APIError 429 `insufficient_quota` (or 503) as `admit` does."""
        quota = TenantLimits(monthly_tokens=tenant.limits.monthly_tokens)
        return await self._acquire(tenant, request_id, quota, tokens)

    async def _acquire(
        self, tenant: RequestTenant, request_id: str, limits: TenantLimits, tokens: int
    ) -> Ticket:
        try:
            reservation, state = await self.limiter.acquire(tenant.id, request_id, limits, tokens)
        except RateLimited as exc:
            self.metrics.rate_limited(tenant.id, exc.code)
            headers = exc.state.headers() | {"Retry-After": str(_seconds(exc.retry_after))}
            raise APIError(
                429,
                exc.message,
                type=_TYPES.get(exc.limit, "requests"),
                code=exc.code,
                headers=headers,
            ) from exc
        except LimiterUnavailable as exc:
            raise APIError(
                503,
                "rate limits cannot be checked right now; try again shortly",
                type="service_unavailable",
                code="rate_limiter_unavailable",
                headers={"Retry-After": str(_seconds(exc.retry_after))},
            ) from exc
        return Ticket(self.limiter, reservation, state, self.releasing)


def _seconds(value: float) -> int:
    """Retry-After takes whole seconds: rounded up, so a client that waits that long gets in."""
    return max(1, math.ceil(value))
