"""Rate-limiter checks per second, and the latency Redis adds to a request.

Runs acquire+release pairs with all four limits set (rpm, tpm, concurrency, monthly quota,
none ever binding) over `--tenants` tenants, through the in-process limiter and the Redis
one, one task at a time and `--concurrency` tasks at once, for `--seconds` each. One process
and one event loop: one core for the limiter (Redis runs in its own process). Latency is per
pair as a task sees it; sequentially that is what the limiter adds to a request. The Redis
rows also count EVALSHA calls per pair from Redis's own command statistics (another client
of the same server would add to them) and per round trip (concurrent tasks' scripts share
a pipeline); `redis PING x2` is the floor, two empty round trips, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import time
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from gateway.tenancy.ratelimit import (
    LimiterOptions,
    RateLimiter,
    RedisLimiter,
    TenantLimits,
    make_limiter,
)

LIMITS = TenantLimits(rpm=10**9, tpm=10**12, max_concurrency=10**6, monthly_tokens=10**15)


@dataclass
class Row:
    limiter: str
    tasks: int
    pairs: int
    seconds: float
    latencies: list[float]
    # acquire() alone: what a request waits for (the gateway releases after the response).
    acquire_latencies: list[float] = field(default_factory=list)
    evalsha_per_pair: float | None = None
    evalsha_per_round_trip: float | None = None

    @property
    def per_second(self) -> float:
        return self.pairs / self.seconds

    def quantile(self, q: float, acquire_only: bool = False) -> float:
        ordered = sorted(self.acquire_latencies if acquire_only else self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run_pairs(limiter: RateLimiter, tasks: int, seconds: float, tenants: int) -> Row:
    latencies: list[float] = []
    acquires: list[float] = []
    deadline = time.perf_counter() + seconds
    counter = 0

    async def worker() -> None:
        nonlocal counter
        while time.perf_counter() < deadline:
            counter += 1
            tenant = f"bench-{counter % tenants}"
            start = time.perf_counter()
            reservation, _ = await limiter.acquire(tenant, f"r{counter}", LIMITS, 300)
            acquires.append(time.perf_counter() - start)
            await limiter.release(reservation, 120)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return Row("", tasks, len(latencies), time.perf_counter() - start, latencies, acquires)


async def ping_pairs(url: str, seconds: float) -> Row:
    """The floor: two PINGs (two round trips with nothing in them) per "pair"."""
    client = aioredis.Redis.from_url(url)
    await client.ping()
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        await client.ping()
        await client.ping()
        latencies.append(time.perf_counter() - t)
    row = Row("redis PING x2", 1, len(latencies), time.perf_counter() - start, latencies)
    await client.aclose()
    return row


def evalsha_calls(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def bench(args: argparse.Namespace) -> list[Row]:
    rows = []
    for tasks in (1, args.concurrency):
        limiter = make_limiter(None)
        await run_pairs(limiter, tasks, 0.2, args.tenants)  # warm up
        row = await run_pairs(limiter, tasks, args.seconds, args.tenants)
        row.limiter = "local"
        rows.append(row)
        await limiter.close()
    if args.redis_url is None:
        return rows
    prefix = f"bench-ratelimit-{secrets.token_hex(4)}"
    admin = redis.Redis.from_url(args.redis_url)
    try:
        rows.append(await ping_pairs(args.redis_url, args.seconds))
        for tasks in (1, args.concurrency):
            limiter = RedisLimiter(
                args.redis_url, LimiterOptions(failure_mode="closed", key_prefix=prefix)
            )
            await run_pairs(limiter, tasks, 0.2, args.tenants)  # connections, script, seeds
            before, trips = evalsha_calls(admin), limiter.pipeline.num_round_trips
            row = await run_pairs(limiter, tasks, args.seconds, args.tenants)
            calls = evalsha_calls(admin) - before
            row.evalsha_per_pair = calls / row.pairs
            row.evalsha_per_round_trip = calls / (limiter.pipeline.num_round_trips - trips)
            row.limiter = "redis"
            rows.append(row)
            await limiter.close()
    finally:
        keys = list(admin.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 1000):
            admin.delete(*keys[start : start + 1000])
        admin.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.ratelimit", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("LORAGATE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="default: $LORAGATE_REDIS_URL or the local server; 'none' for local only",
    )
    p.add_argument("--seconds", type=float, default=2.0, help="per row")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tenants", type=int, default=100)
    args = p.parse_args(argv)
    if args.redis_url == "none":
        args.redis_url = None
    rows = asyncio.run(bench(args))

    table = Table(title="rate limiter: acquire+release pairs, all four limits set")
    columns = ("limiter", "tasks", "pairs/s", "p50 ms", "p99 ms", "EVALSHA/pair", "per trip")
    for column in columns:
        table.add_column(column, justify="left" if column == "limiter" else "right")
    for row in rows:
        table.add_row(
            row.limiter,
            str(row.tasks),
            f"{row.per_second:,.0f}",
            f"{row.quantile(0.5):.3f}",
            f"{row.quantile(0.99):.3f}",
            "-" if row.evalsha_per_pair is None else f"{row.evalsha_per_pair:.2f}",
            "-" if row.evalsha_per_round_trip is None else f"{row.evalsha_per_round_trip:.1f}",
        )
    Console().print(table)
    by_name = {(r.limiter, r.tasks): r for r in rows}
    if ("redis", 1) in by_name:
        sequential = by_name[("redis", 1)]
        redis_p50 = sequential.quantile(0.5)
        floor_p50 = by_name[("redis PING x2", 1)].quantile(0.5)
        mean = statistics.fmean(sequential.latencies) * 1000
        print(
            f"Redis adds {redis_p50:.3f} ms p50 (mean {mean:.3f} ms) per request, acquire + "
            f"release, sequential: {redis_p50 / floor_p50:.2f}x two bare round trips on this "
            f"machine ({floor_p50:.3f} ms); on the request path (acquire; the release runs "
            f"after the response) {sequential.quantile(0.5, acquire_only=True):.3f} ms p50"
        )


if __name__ == "__main__":
    main()
