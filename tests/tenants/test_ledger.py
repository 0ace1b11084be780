"""The usage ledger against SQLite and PostgreSQL: records are durable when record() returns
(group-committed), reach the database exactly once however often a segment is drained, wait
in the spool while the database is away, and survive a kill -9; processes share a spool
directory without draining each other's live segments."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tenants.db import Database, async_url, upgrade
from tenants.ledger import Ledger, UsageRecord
from tenants.spool import PREFIX, SUFFIX

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def usage(i: int, **fields: object) -> UsageRecord:
    values: dict[str, object] = {
        "request_id": f"req-{i}",
        "tenant_id": "ten_a",
        "key_id": "key_a",
        "model": "demo",
        "adapter_name": None,
        "adapter_sha256": None,
        "prompt_tokens": 10 + i,
        "cached_tokens": 0,
        "completion_tokens": 2,
        "finish_reason": "stop",
        "status": "ok",
        "ttft": 0.01,
        "latency": 0.02,
        "created_at": T0 + timedelta(seconds=i),
    }
    return UsageRecord(**(values | fields))  # type: ignore[arg-type]


@pytest.fixture
def db_url(database_url: str) -> str:
    upgrade(database_url)
    return database_url


async def rows(db: Database) -> dict[str, int]:
    """request_id -> prompt_tokens of every row."""
    async with db.engine.connect() as conn:
        result = await conn.execute(text("SELECT request_id, prompt_tokens FROM usage"))
        return {r.request_id: r.prompt_tokens for r in result}


def segments(spool: Path) -> list[Path]:
    return sorted(p for p in spool.glob(f"{PREFIX}*{SUFFIX}"))


def spooled_lines(spool: Path) -> list[str]:
    return [line for p in segments(spool) for line in p.read_text().splitlines()]


def test_a_record_round_trips_and_bad_ones_are_refused() -> None:
    record = usage(1, adapter_name="ünï\u2028code", ttft=None)
    line = record.to_json()
    assert "\n" not in line and "\u2028" not in line
    assert UsageRecord.from_json(line) == record
    assert record.created_epoch == int(T0.timestamp()) + 1
    east = usage(2, created_at=datetime(2026, 11, 30, 14, 0, tzinfo=UTC).astimezone())
    assert east.created_at.tzinfo is UTC
    for bad in (
        {"tenant_id": "t" * 33},
        {"model": "a\x00b"},
        {"status": "done"},
        {"prompt_tokens": -1},
        {"completion_tokens": 1.5},
        {"latency": float("nan")},
        {"ttft": -0.1},
        {"created_at": datetime(2026, 11, 30)},  # naive
        {"request_id": ""},
    ):
        with pytest.raises(ValueError):
            usage(3, **bad)
    for bad_line in ('{"request_id": "x"}', "[]", "not json", line[:-1]):
        with pytest.raises(ValueError):
            UsageRecord.from_json(bad_line)


async def test_concurrent_records_share_one_fsync_and_reach_the_database(
    db_url: str, tmp_path: Path
) -> None:
    db = Database(db_url)
    ledger = Ledger(db, tmp_path / "spool", flush_interval=3600)  # the writer waits for flush()
    await ledger.start()
    try:
        await asyncio.gather(*(ledger.record(usage(i)) for i in range(200)))
        # Durable before the database has seen any of them: every line is on disk.
        assert len(spooled_lines(tmp_path / "spool")) == 200
        assert ledger.num_spooled == 200 and ledger.num_pending == 200
        assert ledger.spool.num_syncs <= 2  # 200 waiters, one write+fdatasync (two at most)
        syncs = ledger.spool.num_syncs
        await ledger.record(usage(200))  # a lone record is written at once, by itself
        assert ledger.spool.num_syncs == syncs + 1

        assert await ledger.flush(timeout=30)
        found = await rows(db)
        assert found == {f"req-{i}": 10 + i for i in range(201)}
        assert ledger.num_written == 201 and ledger.num_pending == 0
        assert segments(tmp_path / "spool") == [ledger.spool.active.path]  # type: ignore[union-attr]
    finally:
        await ledger.close()
        await db.close()
    assert segments(tmp_path / "spool") == []  # an empty active segment is removed on close


async def test_batches_flow_without_flush_calls(db_url: str, tmp_path: Path) -> None:
    """The writer drains on its own: every flush_interval, and at once at a full batch."""
    db = Database(db_url)
    ledger = Ledger(db, tmp_path / "spool", flush_interval=3600, batch_size=50)
    await ledger.start()
    try:
        await asyncio.gather(*(ledger.record(usage(i)) for i in range(120)))
        for _ in range(300):  # a full batch woke the writer; no interval has passed
            if ledger.num_pending == 0:
                break
            await asyncio.sleep(0.02)
        assert len(await rows(db)) == 120
    finally:
        await ledger.close()
        await db.close()


async def test_a_segment_drained_twice_counts_once(db_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    lines = "".join(usage(i).to_json() + "\n" for i in range(30))
    # The same rows in two segments, as a crash between the insert and the unlink leaves them.
    for name in ("usage-1-1-0.jsonl", "usage-1-2-0.jsonl"):
        (spool / name).write_text(lines)
    db = Database(db_url)
    ledger = Ledger(db, spool, batch_size=7)
    try:
        assert await ledger.flush(timeout=30)
        assert len(await rows(db)) == 30
        assert segments(spool) == []
        (spool / "usage-1-3-0.jsonl").write_text(lines)  # and once more, later
        assert await ledger.flush(timeout=30)
        assert len(await rows(db)) == 30
        assert ledger.num_written == 90 and ledger.num_pending == 0
    finally:
        await ledger.close()
        await db.close()


async def test_the_endpoint_reaches_the_database_and_old_lines_without_it_replay(
    db_url: str, tmp_path: Path
) -> None:
    """A record's endpoint goes through the spool into its row; a line spooled by a process
    from before endpoints were recorded (no `endpoint` key) replays with a null one."""
    record = usage(1, endpoint="responses")
    assert UsageRecord.from_json(record.to_json()) == record
    old_line = json.dumps(
        {k: v for k, v in json.loads(usage(2).to_json()).items() if k != "endpoint"}
    )
    assert "endpoint" not in old_line
    assert UsageRecord.from_json(old_line) == usage(2)
    with pytest.raises(ValueError):
        usage(3, endpoint="e" * 33)
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "usage-9-1-0.jsonl").write_text(old_line + "\n")  # a dead process's segment
    db = Database(db_url)
    ledger = Ledger(db, spool)
    await ledger.start()
    try:
        await ledger.record(record)
        await ledger.record(usage(3, endpoint="chat"))
        assert await ledger.flush(timeout=30)
        async with db.engine.connect() as conn:
            found = await conn.execute(text("SELECT request_id, endpoint FROM usage"))
            assert sorted(tuple(r) for r in found) == [
                ("req-1", "responses"),
                ("req-2", None),
                ("req-3", "chat"),
            ]
        assert ledger.num_rejected == 0
    finally:
        await ledger.close()
        await db.close()


async def test_a_torn_last_line_is_skipped_and_bad_lines_are_set_aside(
    db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    good = [usage(i).to_json() for i in range(5)]
    torn = usage(5).to_json()[:40]  # the process died mid-write: no newline
    (spool / "usage-9-1-0.jsonl").write_text("\n".join(good[:2] + ["garbage"] + good[2:]) + "\n")
    (spool / "usage-9-2-0.jsonl").write_text(good[4] + "\n" + torn)
    db = Database(db_url)
    ledger = Ledger(db, spool)
    try:
        with caplog.at_level(logging.WARNING, "tenants.ledger"):
            assert await ledger.flush(timeout=30)
        assert sorted(await rows(db)) == [f"req-{i}" for i in range(5)]
        assert "torn last line" in caplog.text
        assert segments(spool) == []
        assert (spool / "rejected" / "usage-9-1-0.jsonl").read_text() == "garbage\n"
        assert ledger.num_rejected == 1
    finally:
        await ledger.close()
        await db.close()


async def test_a_row_the_database_refuses_is_set_aside_and_the_rest_written(
    db_url: str, tmp_path: Path
) -> None:
    db = Database(db_url)
    async with db.engine.begin() as conn:  # a rule of this database that records don't know
        if db.engine.dialect.name == "sqlite":
            await conn.execute(
                text(
                    "CREATE TRIGGER no_evil BEFORE INSERT ON usage WHEN NEW.model = 'evil' "
                    "BEGIN SELECT RAISE(ABORT, 'no evil'); END"
                )
            )
        else:
            await conn.execute(
                text("ALTER TABLE usage ADD CONSTRAINT no_evil CHECK (model <> 'evil')")
            )
    ledger = Ledger(db, tmp_path / "spool")
    try:
        for i in range(10):
            await ledger.record(usage(i, model="evil" if i == 6 else "demo"))
        assert await ledger.flush(timeout=30)
        assert sorted(await rows(db)) == sorted(f"req-{i}" for i in range(10) if i != 6)
        assert ledger.num_rejected == 1 and ledger.num_written == 9
        rejected = (tmp_path / "spool" / "rejected").iterdir()
        assert '"req-6"' in next(rejected).read_text()
    finally:
        await ledger.close()
        await db.close()


async def test_rows_wait_in_the_spool_while_the_database_is_unreachable(
    db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = tmp_path / "spool"
    if make_url(async_url(db_url)).get_backend_name() == "sqlite":
        (tmp_path / "not-a-file").mkdir()  # SQLite cannot open a directory
        away = f"sqlite+aiosqlite:///{tmp_path / 'not-a-file'}"
    else:
        away = "postgresql://postgres@127.0.0.1:1/test"  # nothing listens on port 1
    down = Database(away)
    ledger = Ledger(down, spool, flush_interval=0.05)
    with caplog.at_level(logging.WARNING, "tenants.ledger"):
        await ledger.start()
        await asyncio.gather(*(ledger.record(usage(i)) for i in range(40)))
        assert not await ledger.flush(timeout=1.5)
        assert ledger.num_db_errors >= 2
        await ledger.close(timeout=0.5)
    await down.close()
    assert caplog.text.count("cannot write to the database") == 1  # once per outage
    assert len(spooled_lines(spool)) == 40  # all kept, for the next process

    db = Database(db_url)  # the database is back (as the next start sees it)
    ledger = Ledger(db, spool)
    try:
        await ledger.start()
        assert await ledger.flush(timeout=30)
        assert await rows(db) == {f"req-{i}": 10 + i for i in range(40)}
        assert segments(spool) == [ledger.spool.active.path]  # type: ignore[union-attr]
    finally:
        await ledger.close()
        await db.close()


@pytest.fixture
def ledger_role(db_url: str) -> Iterator[str]:
    """A PostgreSQL role that may read and insert usage rows (its URL); gone after."""
    if make_url(async_url(db_url)).get_backend_name() != "postgresql":
        pytest.skip("roles and grants are PostgreSQL's")
    role = f"ledger_{secrets.token_hex(4)}"
    conninfo = db_url.replace("postgresql+asyncpg://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(f"GRANT SELECT, INSERT ON usage TO {role}")
    url = make_url(conninfo).set(username=role)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def _grant(db_url: str, statement: str) -> None:
    with psycopg.connect(db_url.replace("postgresql+asyncpg://", "postgresql://")) as conn:
        conn.execute(statement)


async def test_rows_wait_while_insert_is_revoked_then_arrive_once(
    db_url: str, ledger_role: str, tmp_path: Path
) -> None:
    role = make_url(ledger_role).username
    db = Database(ledger_role)
    ledger = Ledger(db, tmp_path / "spool", flush_interval=0.05)
    await ledger.start()
    try:
        await ledger.record(usage(0))
        assert await ledger.flush(timeout=30)
        _grant(db_url, f"REVOKE INSERT ON usage FROM {role}")
        await asyncio.gather(*(ledger.record(usage(i)) for i in range(1, 30)))
        assert not await ledger.flush(timeout=1.0)
        assert ledger.num_pending == 29 and ledger.num_db_errors >= 1
        assert ledger.num_rejected == 0  # refused by permission: retried, never set aside
        await ledger.record(usage(30))  # the request path is not blocked by the outage
        _grant(db_url, f"GRANT INSERT ON usage TO {role}")
        assert await ledger.flush(timeout=30)
        assert await rows(db) == {f"req-{i}": 10 + i for i in range(31)}
    finally:
        await ledger.close()
        await db.close()


async def test_record_nowait_from_a_cancelled_task(db_url: str, tmp_path: Path) -> None:
    db = Database(db_url)
    ledger = Ledger(db, tmp_path / "spool")
    await ledger.start()
    started = asyncio.Event()

    async def stream() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            ledger.record_nowait(usage(7, status="aborted"))

    task = asyncio.create_task(stream())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    try:
        assert await ledger.flush(timeout=30)
        assert await rows(db) == {"req-7": 17}
    finally:
        await ledger.close()
        await db.close()


# -- other processes -----------------------------------------------------------------------------

CHILD = """
import asyncio, sys
from datetime import UTC, datetime
from pathlib import Path
from tenants.db import Database
from tenants.ledger import Ledger, UsageRecord

async def main(url, spool, count, interval):
    ledger = Ledger(Database(url), Path(spool), flush_interval=interval or 1)
    if interval:  # 0: no writer (records are spooled all the same)
        await ledger.start()
    i = 0
    while count < 0 or i < count:
        await ledger.record(UsageRecord(f"req-{i}", "ten_a", None, "demo", None, None, i, 0, 1,
                                        "stop", "ok", None, 0.01, datetime.now(UTC)))
        print(f"req-{i}", flush=True)  # record() returned: durable
        i += 1
    print("done", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
"""


def _child(url: str, spool: Path, count: int, interval: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(spool), str(count), str(interval)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def _kill(child: subprocess.Popen[str]) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    assert child.stdout is not None
    child.stdout.close()


async def test_a_kill_9_loses_nothing_record_returned_for(db_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    # Recording without end, its writer draining every 10 ms: killed at an arbitrary point.
    child = _child(db_url, spool, -1, 0.01)
    assert child.stdout is not None
    printed = []
    try:
        while len(printed) < 150:
            printed.append(await asyncio.to_thread(child.stdout.readline))
            assert printed[-1], "the child ended"
    finally:
        _kill(child)
    printed = [p.strip() for p in printed]

    db = Database(db_url)
    ledger = Ledger(db, spool)
    try:
        await ledger.start()
        assert await ledger.flush(timeout=30)
        found = await rows(db)
        assert set(printed) <= set(found)
        # Records are appended in order, so what reached the disk is a prefix: nothing else.
        assert sorted(found) == sorted(f"req-{i}" for i in range(len(found)))
    finally:
        await ledger.close()
        await db.close()


async def test_another_process_s_live_segment_is_not_drained(db_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    child = _child(db_url, spool, 5, 0)  # no writer: its rows stay in its active segment
    assert child.stdout is not None
    try:
        lines = [await asyncio.to_thread(child.stdout.readline) for _ in range(6)]
        assert lines[-1].strip() == "done"
        db = Database(db_url)
        ledger = Ledger(db, spool)
        await ledger.start()
        await ledger.record(usage(100))
        assert await ledger.flush(timeout=30)
        assert set(await rows(db)) == {"req-100"}  # not the child's: its segment is locked
        assert len(segments(spool)) == 2  # the child's and ours
    finally:
        _kill(child)
    try:
        assert await ledger.flush(timeout=30)  # its lock died with it
        assert set(await rows(db)) == {"req-100"} | {f"req-{i}" for i in range(5)}
    finally:
        await ledger.close()
        await db.close()
