"""The usage ledger: how fast its writer empties the spool into SQLite and PostgreSQL, and what
record() (the durable spool append a request waits for) adds to a request, alone and with 64
writers at once.

Throughput: `--rows` records are spooled first, then one flush() writes them (read the
segments, insert in batches with insert-or-ignore, delete the segments): rows/s of that.
Latency: `--records` record() calls per writer, each timed from the call to its return
(write + fdatasync, shared by every record waiting at once); p50 and p99 in ms, and fsyncs
per record. The spool lives under `--spool-dir` (default: bench/results/, on the same disk as
the checkout: a tmpfs /tmp would make fsync free).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import secrets
import shutil
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tenants.db import Database, upgrade
from tenants.ledger import Ledger, UsageRecord

POSTGRES = os.environ.get("LORAGATE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


_RUN = uuid.uuid4().hex
_ids = itertools.count()


def record() -> UsageRecord:
    return UsageRecord(
        request_id=f"chatcmpl-{_RUN}-{next(_ids)}",
        tenant_id="ten_0123456789abcdef01234567",
        key_id="key_0123456789abcdef01234567",
        model="smollm2",
        adapter_name="sql-lora",
        adapter_sha256="a" * 64,
        prompt_tokens=128,
        cached_tokens=64,
        completion_tokens=64,
        finish_reason="stop",
        status="ok",
        ttft=0.012,
        latency=0.4,
        created_at=datetime.now(UTC),
    )


async def write_throughput(url: str, spool: Path, rows: int, batch_size: int) -> float:
    """Rows per second from a full spool into the database."""
    db = Database(url)
    ledger = Ledger(db, spool, batch_size=batch_size)
    try:
        for start in range(0, rows, 1000):
            await asyncio.gather(*(ledger.record(record()) for _ in range(min(1000, rows - start))))
        began = time.perf_counter()
        assert await ledger.flush(timeout=600), "the database did not take the rows"
        return rows / (time.perf_counter() - began)
    finally:
        await ledger.close()
        await db.close()


async def record_latency(
    url: str, spool: Path, writers: int, records: int
) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, fsyncs per record) of record() with `writers` concurrent writers
    (the writer task draining to the database meanwhile, as in a server)."""
    db = Database(url)
    ledger = Ledger(db, spool)
    await ledger.start()
    times: list[float] = []

    async def writer() -> None:
        for _ in range(records):
            usage = record()
            began = time.perf_counter()
            await ledger.record(usage)
            times.append(time.perf_counter() - began)

    try:
        syncs = ledger.spool.num_syncs
        await asyncio.gather(*(writer() for _ in range(writers)))
        per_record = (ledger.spool.num_syncs - syncs) / len(times)
    finally:
        await ledger.close()
        await db.close()
    cuts = statistics.quantiles(times, n=100)
    return cuts[49] * 1e3, cuts[98] * 1e3, per_record


def _postgres_database() -> tuple[str, str] | None:
    """A fresh database on the PostgreSQL server (its URL, its name), or None without one."""
    import psycopg

    name = f"loragate_bench_{secrets.token_hex(4)}"
    try:
        with psycopg.connect(POSTGRES, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        return None
    return f"{POSTGRES.rsplit('/', 1)[0]}/{name}", name


def _drop(name: str) -> None:
    import psycopg

    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ledger", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20_000, help="rows for the write throughput")
    p.add_argument("--records", type=int, default=200, help="record() calls per writer")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--spool-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--no-postgres", action="store_true")
    args = p.parse_args(argv)

    args.spool_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ledger-", dir=args.spool_dir))
    backends = [("SQLite", f"sqlite+aiosqlite:///{work / 'usage.db'}")]
    made = None if args.no_postgres else _postgres_database()
    if made is not None:
        backends.append(("PostgreSQL", made[0]))
    table = Table(title=f"usage ledger ({args.rows} rows; {args.records} records per writer)")
    for column in ("database", "write rows/s", "writers", "record p50 ms", "p99 ms", "fsyncs/rec"):
        table.add_column(column, justify="right")
    try:
        for name, url in backends:
            upgrade(url)
            rate = asyncio.run(
                write_throughput(url, work / f"spool-{name}", args.rows, args.batch_size)
            )
            for writers in (1, 64):
                p50, p99, syncs = asyncio.run(
                    record_latency(url, work / f"spool-{name}-{writers}", writers, args.records)
                )
                first = writers == 1
                table.add_row(
                    name if first else "",
                    f"{rate:,.0f}" if first else "",
                    str(writers),
                    f"{p50:.2f}",
                    f"{p99:.2f}",
                    f"{syncs:.3f}",
                )
    finally:
        if made is not None:
            _drop(made[1])
        shutil.rmtree(work, ignore_errors=True)
    Console().print(table)


if __name__ == "__main__":
    main()
