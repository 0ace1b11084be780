"""The rate limiter: both stores under one set of semantics, Redis across replicas and
processes, and Redis outages.

The local limiter runs on a fake clock, so its numbers are exact. The Redis one runs on
Redis's clock (buckets refill while a test runs): its tests use limits whose refill is slow
next to a test's milliseconds, or bounds. Both get the same fixed calendar clock, so the
month never turns during a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from gateway.tenancy.ratelimit import (
    LimiterOptions,
    LimiterUnavailable,
    LocalLimiter,
    RateLimited,
    RateLimiter,
    RateState,
    RedisLimiter,
    TenantLimits,
    format_duration,
    make_limiter,
)
from gateway.tenancy.ratelimit.local import QuotaUsed

REDIS_URL = os.environ.get("LORAGATE_TEST_REDIS", "redis://127.0.0.1:6379/0")
JUNE_15 = datetime(2030, 6, 15, 12, tzinfo=UTC).timestamp()
JULY_1 = datetime(2030, 7, 1, tzinfo=UTC).timestamp()


@pytest.fixture
def redis_url() -> str:
    """The Redis server this machine kind runs; skips (fails where
    LORAGATE_SERVICES_REQUIRED=1) when there is none."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        if os.environ.get("LORAGATE_SERVICES_REQUIRED") == "1":
            raise
        pytest.skip(f"no Redis at {REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of the test's own; its keys are deleted after."""
    name = f"lgtest-{secrets.token_hex(6)}"
    yield name
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{name}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    yield client
    client.close()


class FakeClock:
    def __init__(self, now: float = JUNE_15) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    """Makes limiters of one kind and moves time for them: the fake clock for the local
    one, real sleep for Redis (whose buckets run on its own clock)."""

    kind: str
    url: str | None
    prefix: str
    clock: FakeClock = field(default_factory=FakeClock)
    limiters: list[RateLimiter] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.kind == "local"

    def new(self, quota_used: QuotaUsed | None = None, **options: Any) -> RateLimiter:
        limiter = make_limiter(
            self.url,
            LimiterOptions(key_prefix=self.prefix, **options),
            quota_used=quota_used,
            clock=self.clock,
        )
        self.limiters.append(limiter)
        return limiter

    async def wait(self, seconds: float) -> None:
        if self.exact:
            self.clock.now += seconds
        else:
            await asyncio.sleep(seconds)


@pytest.fixture(params=["local", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "local":
        h = Harness("local", None, "unused")
    else:
        h = Harness(
            "redis", request.getfixturevalue("redis_url"), request.getfixturevalue("prefix")
        )
    yield h
    for limiter in h.limiters:
        await limiter.close()


async def refused(limiter: RateLimiter, limits: TenantLimits, tokens: int = 0) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        await limiter.acquire("t", f"req-{secrets.token_hex(4)}", limits, tokens)
    return info.value


async def admitted(limiter: RateLimiter, limits: TenantLimits, tokens: int = 0) -> Any:
    return await limiter.acquire("t", f"req-{secrets.token_hex(4)}", limits, tokens)


# -- rpm --------------------------------------------------------------------------------------


async def test_rpm_admits_exactly_n_of_a_burst(harness: Harness) -> None:
    limiter = harness.new()
    limits = TenantLimits(rpm=5)
    states = [(await admitted(limiter, limits))[1] for _ in range(5)]
    assert [s.remaining_requests for s in states] == [4, 3, 2, 1, 0]
    err = await refused(limiter, limits)
    assert err.code == "rate_limit_exceeded" and err.limit == "rpm"
    assert err.message.startswith(
        "Rate limit reached for requests per minute (rpm): Limit 5, Used 5, Requested 1. "
        "Please try again in "
    )
    assert err.state.remaining_requests == 0 and err.state.limit_tokens is None
    assert limiter.num_refused == 1
    if harness.exact:
        assert err.retry_after == pytest.approx(12.0)
        assert err.message.endswith("Please try again in 12s.")
        assert err.state.reset_requests == pytest.approx(60.0)
        harness.clock.now += 11.9
        assert (await refused(limiter, limits)).retry_after == pytest.approx(0.1)
        harness.clock.now += 0.1
        await admitted(limiter, limits)
        await refused(limiter, limits)
    else:
        assert 11.0 <= err.retry_after <= 12.0


async def test_rpm_refills_one_per_interval(harness: Harness) -> None:
    limiter = harness.new()
    limits = TenantLimits(rpm=120)  # one more every 0.5 s
    for _ in range(200):
        try:
            await admitted(limiter, limits)
        except RateLimited as exc:
            err = exc
            break
    else:
        pytest.fail("a burst of 200 passed an rpm of 120")
    assert 0 < err.retry_after <= 0.5
    await harness.wait(err.retry_after + 0.02)
    await admitted(limiter, limits)


# -- tpm --------------------------------------------------------------------------------------


async def test_tpm_refunds_the_unused_reservation(harness: Harness) -> None:
    limiter = harness.new()
    limits = TenantLimits(tpm=1000)
    reservation, state = await admitted(limiter, limits, 600)  # prompt + max_tokens
    assert state.limit_tokens == 1000 and state.limit_requests is None
    assert 400 <= state.remaining_tokens <= 402
    await limiter.release(reservation, 100)  # it used 100
    _, state = await admitted(limiter, limits, 1)
    assert 899 <= state.remaining_tokens <= 902
    if harness.exact:
        assert state.remaining_tokens == 899
        assert state.reset_tokens == pytest.approx(101 * 60 / 1000)


async def test_a_refusal_reserves_nothing(harness: Harness) -> None:
    limiter = harness.new()
    limits = TenantLimits(rpm=10, tpm=100)
    await admitted(limiter, limits, 80)
    err = await refused(limiter, limits, 50)
    assert err.limit == "tpm"
    assert err.message.startswith(
        "Rate limit reached for tokens per minute (tpm): Limit 100, Used 80, Requested 50."
    )
    if harness.exact:
        assert err.retry_after == pytest.approx(18.0)  # 30 tokens at 100/60 per second
    too_large = await refused(limiter, limits, 101)
    assert too_large.limit == "tpm" and "Request too large" in too_large.message
    assert "lower max_tokens" in too_large.message
    if harness.exact:
        assert too_large.retry_after == pytest.approx(48.0)  # until the bucket is full
    _, state = await admitted(limiter, limits, 1)
    assert state.remaining_requests == 8  # the two refusals took no request
    assert 19 <= state.remaining_tokens <= 20


async def test_release_is_idempotent(harness: Harness) -> None:
    limiter = harness.new()
    limits = TenantLimits(tpm=1000)
    first, _ = await admitted(limiter, limits, 500)
    await admitted(limiter, limits, 500)
    await limiter.release(first, 500)
    await limiter.release(first, 0)  # a second release refunds nothing
    assert (await refused(limiter, limits, 1)).limit == "tpm"


# -- concurrency ------------------------------------------------------------------------------


async def test_concurrency_slots(harness: Harness) -> None:
    limiter = harness.new()
    limits = TenantLimits(max_concurrency=2)
    a, _ = await limiter.acquire("t", "a", limits, 0)
    await limiter.acquire("t", "b", limits, 0)
    err = await refused(limiter, limits)
    assert err.limit == "concurrency" and err.code == "rate_limit_exceeded"
    assert "Limit 2, In flight 2" in err.message
    assert err.retry_after == pytest.approx(1.0)
    await limiter.release(a, 0)
    await limiter.acquire("t", "c", limits, 0)
    await limiter.release(a, 0)  # twice: harmless, frees nothing more
    await refused(limiter, limits)
    await limiter.acquire("other-tenant", "a", limits, 0)  # slots are per tenant


async def test_an_expired_lease_frees_its_slot(harness: Harness) -> None:
    limiter = harness.new(concurrency_lease=1.0)
    limits = TenantLimits(max_concurrency=1)
    await admitted(limiter, limits)  # and never released: its gateway crashed
    err = await refused(limiter, limits)
    assert 0 < err.retry_after <= 1.0
    await harness.wait(1.05)
    await admitted(limiter, limits)


# -- the monthly quota ------------------------------------------------------------------------


class Ledger:
    def __init__(self, used: int) -> None:
        self.used = used
        self.calls: list[tuple[str, datetime]] = []

    async def __call__(self, tenant_id: str, month_start: datetime) -> int:
        self.calls.append((tenant_id, month_start))
        await asyncio.sleep(0.01)
        return self.used


async def test_monthly_quota(harness: Harness) -> None:
    ledger = Ledger(used=900)
    limiter = harness.new(quota_used=ledger)
    limits = TenantLimits(monthly_tokens=1000)
    reservation, _ = await admitted(limiter, limits, 50)
    assert ledger.calls == [("t", datetime(2030, 6, 1, tzinfo=UTC))]
    await limiter.release(reservation, 150)  # 900 + 150: spent
    err = await refused(limiter, limits, 1)
    assert err.code == "insufficient_quota" and err.limit == "monthly_tokens"
    assert err.message.startswith("You exceeded your current quota")
    assert "monthly token quota 1000, used 1050" in err.message
    assert err.retry_after == pytest.approx(JULY_1 - JUNE_15)
    assert len(ledger.calls) == 1

    # Concurrent first requests of a tenant ask the ledger once.
    results = await asyncio.gather(*(limiter.acquire("u", f"u{i}", limits, 10) for i in range(5)))
    assert len(results) == 5
    assert [c[0] for c in ledger.calls] == ["t", "u"]

    if harness.exact:  # a new month starts from the ledger again
        harness.clock.now = JULY_1 + 1
        ledger.used = 0
        await admitted(limiter, limits, 1)
        assert ledger.calls[-1] == ("t", datetime(2030, 7, 1, tzinfo=UTC))


async def test_monthly_quota_survives_a_new_limiter(redis_url: str, prefix: str) -> None:
    limits = TenantLimits(monthly_tokens=1000)
    clock = FakeClock()
    first = RedisLimiter(
        redis_url, LimiterOptions(key_prefix=prefix), clock=clock, quota_used=Ledger(1000)
    )
    ledger = Ledger(used=0)  # a restarted replica, whose ledger lags
    second = RedisLimiter(
        redis_url, LimiterOptions(key_prefix=prefix), clock=clock, quota_used=ledger
    )
    try:
        await refused(first, limits, 1)
        assert (await refused(second, limits, 1)).code == "insufficient_quota"
        assert ledger.calls == []
    finally:
        await first.close()
        await second.close()


async def test_a_ledger_that_fails(harness: Harness) -> None:
    async def broken(tenant_id: str, month_start: datetime) -> int:
        raise OSError("database down")

    limits = TenantLimits(monthly_tokens=1000)
    opened = harness.new(quota_used=broken)
    await admitted(opened, limits, 10)  # open: admitted without the quota this once
    closed = harness.new(quota_used=broken, failure_mode="closed")
    with pytest.raises(LimiterUnavailable):
        await admitted(closed, limits, 10)


# -- tenants without limits -------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_no_limits_cost_nothing() -> None:
    limiter = make_limiter(
        f"redis://127.0.0.1:{closed_port()}", LimiterOptions(failure_mode="closed")
    )
    assert isinstance(limiter, RedisLimiter)
    reservation, state = await limiter.acquire("t", "r", TenantLimits(), 100)
    assert state.headers() == {} and not reservation.tracked
    await limiter.release(reservation, 100)
    assert limiter.num_redis_errors == 0  # never asked Redis
    await limiter.close()
    assert isinstance(make_limiter(None), LocalLimiter)


async def test_negative_tokens_are_refused(harness: Harness) -> None:
    with pytest.raises(ValueError, match="tokens"):
        await admitted(harness.new(), TenantLimits(tpm=10), -1)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="rpm"):
        TenantLimits(rpm=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        TenantLimits(max_concurrency=-1)
    with pytest.raises(ValueError, match="failure_mode"):
        LimiterOptions(failure_mode="sideways")  # type: ignore[arg-type]


# -- headers ----------------------------------------------------------------------------------


def test_duration_format() -> None:
    assert format_duration(0) == "0s"
    assert format_duration(0.02) == "20ms"
    assert format_duration(0.0001) == "1ms"  # a wait that is not over never reads 0
    assert format_duration(1) == "1s"
    assert format_duration(11.2) == "11.2s"
    assert format_duration(17.2791) == "17.28s"
    assert format_duration(86.4) == "1m26.4s"
    assert format_duration(360) == "6m0s"
    assert format_duration(3600) == "1h0m0s"


def test_headers() -> None:
    state = RateState(5, 4, 12.0, 1000, 0, 360.0)
    assert state.headers() == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-reset-requests": "12s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    only_tokens = RateState(limit_tokens=1000, remaining_tokens=10, reset_tokens=0.02)
    assert only_tokens.headers() == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "10",
        "x-ratelimit-reset-tokens": "20ms",
    }
    assert RateState().headers() == {}


# -- Redis across replicas --------------------------------------------------------------------


async def test_two_replicas_share_one_limit(redis_url: str, prefix: str) -> None:
    replicas = [RedisLimiter(redis_url, LimiterOptions(key_prefix=prefix)) for _ in range(2)]
    try:
        limits = TenantLimits(rpm=10)
        passed = 0
        for i in range(30):
            try:
                await replicas[i % 2].acquire("t", f"r{i}", limits, 0)
                passed += 1
            except RateLimited:
                pass
        assert passed == 10  # not 2 x 10

        limits = TenantLimits(max_concurrency=3)
        held = []
        for i in range(8):
            with contextlib.suppress(RateLimited):
                held.append((await replicas[i % 2].acquire("t", f"c{i}", limits, 0))[0])
        assert len(held) == 3
        await replicas[1].release(held[0], 0)  # a slot taken on one replica, freed on another
        await replicas[0].acquire("t", "c-next", limits, 0)
    finally:
        for limiter in replicas:
            await limiter.close()


async def test_concurrent_checks_share_a_round_trip(
    redis_url: str, prefix: str, admin: redis.Redis
) -> None:
    limiter = RedisLimiter(redis_url, LimiterOptions(key_prefix=prefix))
    try:
        limits = TenantLimits(rpm=10, max_concurrency=100)
        results = await asyncio.gather(
            *(limiter.acquire("t", f"r{i}", limits, 0) for i in range(64)),
            return_exceptions=True,
        )
        held = [r[0] for r in results if not isinstance(r, BaseException)]
        assert len(held) == 10
        assert all(isinstance(r, RateLimited) for r in results if isinstance(r, BaseException))
        assert limiter.pipeline.num_round_trips == 1  # 64 scripts, one pipeline
        await asyncio.gather(*(limiter.release(r, 0) for r in held))
        assert limiter.pipeline.num_round_trips == 2
        assert admin.zcard(f"{prefix}:{{t}}:inflight") == 0

        # Redis lost its scripts (a restart, SCRIPT FLUSH): a batch reloads them.
        admin.script_flush()
        limits = TenantLimits(rpm=1000)
        await asyncio.gather(*(limiter.acquire("u", f"u{i}", limits, 0) for i in range(8)))
        assert limiter.num_redis_errors == 0 and not limiter.using_fallback
    finally:
        await limiter.close()


async def test_cancelled_callers(redis_url: str, prefix: str, admin: redis.Redis) -> None:
    limiter = RedisLimiter(redis_url, LimiterOptions(key_prefix=prefix))
    limits = TenantLimits(max_concurrency=1)
    try:
        # An acquire cancelled before its script went out reserves nothing.
        task = asyncio.ensure_future(limiter.acquire("t", "gone", limits, 0))
        await asyncio.sleep(0)  # queued in the pipeline
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reservation, _ = await limiter.acquire("t", "held", limits, 0)

        # A release whose caller is cancelled still frees the slot.
        task = asyncio.ensure_future(limiter.release(reservation, 0))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if admin.zcard(f"{prefix}:{{t}}:inflight") == 0:
                break
            await asyncio.sleep(0.01)
        await limiter.acquire("t", "next", limits, 0)
    finally:
        await limiter.close()


def _hammer(url: str, prefix: str, rpm: int, attempts: int, barrier: Any, out: Any) -> None:
    """One "replica" process: 64 tasks acquire `attempts` times in all, after the barrier."""

    async def run() -> tuple[int, float, float, int]:
        # A generous timeout: on a busy two-core machine one 0.25 s stall of 128 processes'
        # tasks would fall back to a per-process limit, which is not what this test measures.
        limiter = RedisLimiter(url, LimiterOptions(key_prefix=prefix, timeout=5.0))
        limits = TenantLimits(rpm=rpm)
        await limiter.acquire("warmup", "w", limits, 0)  # connect, load the script
        barrier.wait(timeout=60)
        passed = 0

        async def worker(ids: range) -> None:
            nonlocal passed
            for i in ids:
                try:
                    await limiter.acquire("t", f"{os.getpid()}-{i}", limits, 0)
                    passed += 1
                except RateLimited:
                    pass

        start = time.time()
        await asyncio.gather(*(worker(range(k, attempts, 64)) for k in range(64)))
        end = time.time()
        await limiter.close()
        return passed, start, end, limiter.num_fallback

    out.put(asyncio.run(run()))


def test_two_processes_admit_exactly_n(redis_url: str, prefix: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    rpm, attempts = 20, 150  # one more every 3 s: a burst of well under that admits 20
    procs = [
        ctx.Process(target=_hammer, args=(redis_url, prefix, rpm, attempts, barrier, out))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=60)
        results = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
    passed = sum(r[0] for r in results)
    elapsed = max(r[2] for r in results) - min(r[1] for r in results)
    # Exactly rpm, plus whatever refilled while the burst ran (nothing under 3 s).
    assert rpm <= passed <= rpm + int(elapsed * rpm / 60)
    assert all(p.exitcode == 0 for p in procs)
    assert all(r[3] == 0 for r in results)  # no request fell back to a per-process limit


# -- Redis outages ----------------------------------------------------------------------------


async def test_outage_open_falls_back_to_local_limits(caplog: pytest.LogCaptureFixture) -> None:
    limiter = make_limiter(
        f"redis://127.0.0.1:{closed_port()}", LimiterOptions(failure_mode="open")
    )
    assert isinstance(limiter, RedisLimiter)
    limits = TenantLimits(rpm=2)
    with caplog.at_level(logging.WARNING, logger="gateway.tenancy.ratelimit"):
        await admitted(limiter, limits)
        reservation, _ = await admitted(limiter, limits)
        assert (await refused(limiter, limits)).limit == "rpm"  # the fallback's own limits
    assert reservation.backend == "local"
    assert limiter.using_fallback and limiter.num_fallback == 3
    assert limiter.num_redis_errors == 1  # probed once, not on every request
    assert limiter.num_refused == 1
    assert len([r for r in caplog.records if "does not answer" in r.message]) == 1
    await limiter.close()


async def test_outage_closed_refuses() -> None:
    limiter = make_limiter(
        f"redis://127.0.0.1:{closed_port()}", LimiterOptions(failure_mode="closed")
    )
    with pytest.raises(LimiterUnavailable) as info:
        await admitted(limiter, TenantLimits(rpm=2))
    assert 0 < info.value.retry_after <= 1.0
    await limiter.close()


async def test_outage_and_recovery(
    redis_url: str, prefix: str, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = RedisLimiter(redis_url, LimiterOptions(key_prefix=prefix))
    limits = TenantLimits(rpm=10, tpm=100_000)  # the rpm key lives 6 s per request
    rpm_key = f"{prefix}:{{t}}:rpm"
    try:
        on_redis, _ = await admitted(limiter, limits, 10)
        assert on_redis.backend == "redis" and not limiter.using_fallback
        before = admin.get(rpm_key)
        assert before is not None
        with caplog.at_level(logging.INFO, logger="gateway.tenancy.ratelimit"):
            # Redis holds every write (and script) for 600 ms; reads still answer.
            admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")
            local, _ = await admitted(limiter, limits, 10)  # after one 0.25 s timeout
            assert local.backend == "local" and limiter.using_fallback
            await admitted(limiter, limits, 10)  # no second try within the probe interval
            assert limiter.num_redis_errors == 1 and limiter.num_fallback == 2
            await limiter.release(on_redis, 5)  # dropped: its lease frees it
            await limiter.release(local, 5)  # to the local limiter
            assert limiter.num_dropped_releases == 1
            assert admin.get(rpm_key) == before
            await asyncio.sleep(1.1)  # the pause is over and the probe is due
            back, _ = await admitted(limiter, limits, 10)
        assert back.backend == "redis" and not limiter.using_fallback
        assert admin.get(rpm_key) != before
        assert len([r for r in caplog.records if "does not answer" in r.message]) == 1
        assert any("answers again" in r.message for r in caplog.records)
        assert any("dropped the release" in r.message for r in caplog.records)
    finally:
        await limiter.close()


async def test_outage_closed_then_recovery(redis_url: str, prefix: str, admin: redis.Redis) -> None:
    limiter = RedisLimiter(redis_url, LimiterOptions(failure_mode="closed", key_prefix=prefix))
    limits = TenantLimits(rpm=1000)
    try:
        await admitted(limiter, limits)
        admin.execute_command("CLIENT", "PAUSE", 600, "WRITE")
        with pytest.raises(LimiterUnavailable) as info:
            await admitted(limiter, limits)
        assert 0.5 < info.value.retry_after <= 1.0
        with pytest.raises(LimiterUnavailable):
            await admitted(limiter, limits)  # fails fast until the probe is due
        assert limiter.num_redis_errors == 1 and not limiter.using_fallback
        await asyncio.sleep(1.1)
        reservation, _ = await admitted(limiter, limits)
        assert reservation.backend == "redis"
    finally:
        await limiter.close()
