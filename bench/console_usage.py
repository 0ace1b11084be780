"""The admin console's usage queries on a big ledger: PostgreSQL, 1,000,000 usage rows over a
year, 1,000 tenants, each query timed at migration 0004 and at 0005.

    loragate-bench console-usage [--database-url postgresql://...] [--rows 1000000]
        [--tenants 1000] [--repeat 5] [--seed 0]

It makes a database of its own on the server `--database-url` names (and drops it after),
migrates it to 0004, fills it with COPY (seeded, deterministic data: tenants of Zipf-like
sizes, five models, 300 adapters, a third of the requests on the base model), and times each
of the console's queries, the product's own functions over asyncpg (median of `--repeat`):

- day x tenant, top 10: the billing chart stacked by tenant, one year;
- day x model, top 10, and day x adapter, top 10: the same stacked by model and adapter;
- a tenants page of 50 with this month's tokens.

Then it migrates to head (0005: the covering index and the day bucket's statistics; the time
it takes on this table is shown), times the same queries again, and checks that every answer
is the same. After each migration it runs VACUUM ANALYZE, as autovacuum would have on a
ledger in steady state: without the visibility map, PostgreSQL cannot answer from an index
alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import make_url

from bench.workloads import new_progress
from tenants.db import Database, upgrade
from tenants.tenants import page_tenants
from tenants.usage import DAY, month_tokens, summarize_usage

DEFAULT_SERVER = os.environ.get(
    "LORAGATE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"
)
# The data's "now": mid-December, so that this month has two weeks of rows.
NOW = int(datetime(2026, 12, 15, 12, tzinfo=UTC).timestamp())
YEAR = 365 * DAY
MODELS = ("smollm2", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "llama-3.2-1b")
MODEL_WEIGHTS = (0.45, 0.25, 0.15, 0.1, 0.05)
NUM_ADAPTERS = 300
BASE_MODEL_SHARE = 1 / 3  # of the requests: no adapter
ENDPOINTS = ("chat", "completions", "responses", None)
ENDPOINT_WEIGHTS = (0.6, 0.2, 0.15, 0.05)
PAGE = 50
TOP = 10
COPY_CHUNK = 50_000


@dataclass(frozen=True, slots=True)
class Ledger:
    """The seeded data set: the tenants' ids, and what to fill the usage table with."""

    tenant_ids: list[str]
    rows: int
    seed: int


def _zipf_weights(n: int, s: float = 1.1) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return weights / weights.sum()


def _tenant_ids(num_tenants: int, rng: np.random.Generator) -> list[str]:
    return [f"ten_{rng.bytes(12).hex()}" for _ in range(num_tenants)]


def _tenants_copy(tenant_ids: list[str]) -> bytes:
    """The tenants table's rows, one created a minute after the other a year before NOW."""
    lines = []
    for i, tenant_id in enumerate(tenant_ids):
        created = datetime.fromtimestamp(NOW - YEAR + 60 * i, UTC).isoformat()
        lines.append(f"{tenant_id}\tbench-{i:05d}\tactive\t{created}\t1.0\n")
    return "".join(lines).encode()


def _usage_copy(ledger: Ledger, start: int, stop: int, rng: np.random.Generator) -> bytes:
    """Rows start..stop of the usage table as COPY text, ordered by time as the ledger appends
    them (row i's time grows with i)."""
    n = stop - start
    tenants = rng.choice(len(ledger.tenant_ids), size=n, p=_zipf_weights(len(ledger.tenant_ids)))
    keys = rng.integers(0, 2, size=n)  # two keys a tenant
    no_key = rng.random(n) < 0.05  # and 5 % of the requests without a key
    models = rng.choice(len(MODELS), size=n, p=MODEL_WEIGHTS)
    adapters = rng.choice(NUM_ADAPTERS, size=n, p=_zipf_weights(NUM_ADAPTERS, 0.8))
    base = rng.random(n) < BASE_MODEL_SHARE
    endpoints = rng.choice(len(ENDPOINTS), size=n, p=ENDPOINT_WEIGHTS)
    prompt = np.minimum(rng.lognormal(5.5, 1.0, size=n).astype(np.int64) + 1, 32_000)
    cached = (prompt * rng.random(n) * 0.5).astype(np.int64)
    completion = np.minimum(rng.lognormal(4.5, 1.0, size=n).astype(np.int64) + 1, 8_000)
    latency = completion * 0.01 + 0.05
    # Evenly over the year before NOW, in order.
    epochs = NOW - YEAR + (np.arange(start, stop, dtype=np.int64) * YEAR) // ledger.rows
    created = np.datetime_as_string(epochs.astype("datetime64[s]"), unit="s")
    # Every field as text first: formatting numpy's scalars one by one is 10x slower.
    tenant_ids = [ledger.tenant_ids[t] for t in tenants.tolist()]
    key_ids = [
        "\\N" if none else f"key_{t:012d}{k:012d}"
        for t, k, none in zip(tenants.tolist(), keys.tolist(), no_key.tolist(), strict=True)
    ]
    adapter_fields = [f"lora-{a:03d}\t{a:064x}" for a in range(NUM_ADAPTERS)]
    adapter_of = [
        "\\N\t\\N" if on_base else adapter_fields[a]
        for a, on_base in zip(adapters.tolist(), base.tolist(), strict=True)
    ]
    endpoint_of = [e or "\\N" for e in ENDPOINTS]
    lines = [
        f"req-{ledger.seed}-{start + i}\t{tenant_ids[i]}\t{key_ids[i]}\t{MODELS[m]}\t"
        f"{adapter_of[i]}\t{p}\t{c}\t{o}\tstop\tok\t0.02\t{lat:.3f}\t{at}+00\t{epoch}\t"
        f"{endpoint_of[e]}\n"
        for i, (m, p, c, o, lat, at, epoch, e) in enumerate(
            zip(
                models.tolist(),
                prompt.tolist(),
                cached.tolist(),
                completion.tolist(),
                latency.tolist(),
                created.tolist(),
                epochs.tolist(),
                endpoints.tolist(),
                strict=True,
            )
        )
    ]
    return "".join(lines).encode()


USAGE_COLUMNS = (
    "request_id, tenant_id, key_id, model, adapter_name, adapter_sha256, prompt_tokens, "
    "cached_tokens, completion_tokens, finish_reason, status, ttft, latency, created_at, "
    "created_epoch, endpoint"
)


def fill(url: str, ledger: Ledger, on_chunk: Callable[[int], None]) -> None:
    """COPY the tenants and `ledger.rows` usage rows into the (migrated, empty) database."""
    import psycopg

    rng = np.random.default_rng(ledger.seed)
    with psycopg.connect(_libpq(url)) as conn, conn.cursor() as cur:
        with cur.copy("COPY tenants (id, name, status, created_at, weight) FROM STDIN") as copy:
            copy.write(_tenants_copy(ledger.tenant_ids))
        with cur.copy(f"COPY usage ({USAGE_COLUMNS}) FROM STDIN") as copy:
            for start in range(0, ledger.rows, COPY_CHUNK):
                stop = min(start + COPY_CHUNK, ledger.rows)
                copy.write(_usage_copy(ledger, start, stop, rng))
                on_chunk(stop - start)


def vacuum(url: str) -> None:
    import psycopg

    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE usage")
        conn.execute("VACUUM ANALYZE tenants")


def add_later_tenant_columns(url: str) -> list[str]:
    """The console's queries are the product's, which read `tenants` as the models have it
    now: the columns later revisions added to it (none indexed, no usage row touched) are
    added for the 0004 timing and dropped before the migration adds them for real."""
    import psycopg
    from sqlalchemy.dialects import postgresql

    from tenants.models import Tenant

    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        present = {
            row[0]
            for row in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'tenants'"
            )
        }
        added = []
        for column in Tenant.__table__.columns:
            if column.name not in present:
                kind = column.type.compile(dialect=postgresql.dialect())
                conn.execute(f'ALTER TABLE tenants ADD COLUMN "{column.name}" {kind}')
                added.append(column.name)
    return added


def drop_tenant_columns(url: str, names: list[str]) -> None:
    import psycopg

    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        for name in names:
            conn.execute(f'ALTER TABLE tenants DROP COLUMN "{name}"')


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


# -- the console's queries ------------------------------------------------------------------------


def queries(db: Database) -> dict[str, Callable[[], Awaitable[object]]]:
    """The console's queries by name, each reading a year (the tenants page: this month)."""
    first = NOW - YEAR

    def chart(grouping: str) -> Callable[[], Awaitable[object]]:
        async def run() -> object:
            async with db.session() as session:
                return await summarize_usage(
                    session, start=first, end=NOW, group_by=("day", grouping), top=TOP
                )

        return run

    async def tenants_page() -> object:
        async with db.session() as session:
            page = await page_tenants(session, limit=PAGE)
            return await month_tokens(session, tenant_ids=[t.id for t in page.tenants], now=NOW)

    return {
        f"day x tenant, top {TOP}": chart("tenant"),
        f"day x model, top {TOP}": chart("model"),
        f"day x adapter, top {TOP}": chart("adapter"),
        f"tenants page of {PAGE}, month_tokens": tenants_page,
    }


NUM_QUERIES = 4


@dataclass(frozen=True, slots=True)
class Timed:
    seconds: float  # the median
    answer: object  # what the query answered (the same with and without 0005, or a bug)


async def time_queries(url: str, repeat: int, on_run: Callable[[], None]) -> dict[str, Timed]:
    """Each query timed `repeat` times, after one untimed run (to warm the pool and the
    cache)."""
    db = Database(url)
    timed = {}
    try:
        for name, query in queries(db).items():
            answer = await query()
            times = []
            for _ in range(repeat):
                began = time.perf_counter()
                await query()
                times.append(time.perf_counter() - began)
                on_run()
            timed[name] = Timed(statistics.median(times), answer)
    finally:
        await db.close()
    return timed


# -- a database of its own --------------------------------------------------------------------


def create_database(server: str) -> tuple[str, str]:
    """A fresh database on the server (its URL, its name)."""
    import psycopg

    name = f"loragate_bench_{secrets.token_hex(4)}"
    with psycopg.connect(_libpq(server), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(server).set(database=name).render_as_string(hide_password=False), name


def drop_database(server: str, name: str) -> None:
    import psycopg

    with psycopg.connect(_libpq(server), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="loragate-bench console-usage", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--database-url",
        default=DEFAULT_SERVER,
        help="a PostgreSQL server (the bench makes a database of its own there, and drops it)",
    )
    p.add_argument("--rows", type=int, default=1_000_000, help="usage rows")
    p.add_argument("--tenants", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5, help="runs per query (their median)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rows < 1 or args.tenants < 1 or args.repeat < 1:
        p.error("--rows, --tenants and --repeat: at least 1")

    console = Console()
    url, name = create_database(args.database_url)
    rng = np.random.default_rng(args.seed)
    ledger = Ledger(_tenant_ids(args.tenants, rng), args.rows, args.seed)
    try:
        upgrade(url, "0004")
        began = time.perf_counter()
        with new_progress(console) as progress:
            task = progress.add_task("filling the usage table", total=args.rows)
            fill(url, ledger, lambda n: progress.advance(task, n))
            fill_s = time.perf_counter() - began
            vacuum(url)
            runs = NUM_QUERIES * args.repeat
            task = progress.add_task("queries at 0004", total=runs)
            added = add_later_tenant_columns(url)
            before = asyncio.run(time_queries(url, args.repeat, lambda: progress.advance(task)))
            drop_tenant_columns(url, added)
            began = time.perf_counter()
            upgrade(url)
            index_s = time.perf_counter() - began
            vacuum(url)
            task = progress.add_task("queries at 0005", total=runs)
            after = asyncio.run(time_queries(url, args.repeat, lambda: progress.advance(task)))
    finally:
        drop_database(args.database_url, name)

    for query, timed in before.items():
        if timed.answer != after[query].answer:
            raise SystemExit(f"{query}: 0005 changed the answer")

    table = Table(
        title=f"console usage queries: {args.rows:,} rows over a year, {args.tenants:,} "
        f"tenants, PostgreSQL (median of {args.repeat})"
    )
    for column in ("query", "0004 ms", "0005 ms", "0004 / 0005"):
        table.add_column(column, justify="right")
    for query, timed in before.items():
        without, with_ = timed.seconds, after[query].seconds
        table.add_row(
            query, f"{without * 1e3:,.1f}", f"{with_ * 1e3:,.1f}", f"{without / with_:.2f}"
        )
    console.print(table)
    rate = args.rows / fill_s
    console.print(f"filled in {fill_s:.1f} s ({rate:,.0f} rows/s); 0005 applied in {index_s:.1f} s")


if __name__ == "__main__":
    main()
