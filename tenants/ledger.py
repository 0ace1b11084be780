"""The usage ledger: one durable row per request, spooled first, written to the database in
batches.

    record() ─► queue ─► group commit: one write + fdatasync for every record waiting
                             │  (tenants/spool.py: this process's active segment)
                             ▼
                writer task, every flush_interval or at a full batch:
                seal the active segment, adopt segments no process holds, insert their rows
                in batches (insert-or-ignore on request_id), then delete the segment

`record()` returns once its line is on disk, so a crash at any point after loses nothing: the
segment is drained by this process, or, if it died, by the next that starts (or any other
running on the same spool directory). The database may be down or refuse: segments stay and
are retried with back-off; inserting by request_id makes a segment drained twice (a crash
between the insert and the unlink) count once. The request path never waits for the
database and never shares a session with the writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError

from tenants.db import Database
from tenants.models import USAGE_STATUSES, Usage
from tenants.spool import Segment, Spool

logger = logging.getLogger(__name__)

MAX_BACKOFF = 5.0
MAX_ADOPTED = 16  # dead processes' segments taken per cycle
CLOSE_TIMEOUT = 5.0
_MAX_TOKENS = (1 << 31) - 1
# Column lengths (tenants/models.py): a record that does not fit is refused at record(), not
# found out when it reaches the database and blocks its segment.
_LENGTHS = {
    name: Usage.__table__.c[name].type.length  # type: ignore[attr-defined]
    for name in (
        "request_id",
        "tenant_id",
        "key_id",
        "model",
        "adapter_name",
        "adapter_sha256",
        "finish_reason",
        "endpoint",
        "batch_id",
    )
}


@dataclass(slots=True)
class UsageRecord:
    """A request's usage, as the `usage` table holds it (created_epoch is derived)."""

    request_id: str
    tenant_id: str
    key_id: str | None
    model: str
    adapter_name: str | None
    adapter_sha256: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None
    status: str  # "ok" | "aborted" | "error"
    ttft: float | None  # seconds
    latency: float  # seconds
    created_at: datetime  # timezone-aware
    # The API the request came through ("completions", "chat", "responses", "batch").
    # Last, with a default: spool lines written before it existed replay as None.
    endpoint: str | None = None
    # The batch a line of which this request was (tenants/batch_lines.py writes those rows
    # itself, with the line's answer); None: not a batch's. A default, as `endpoint`.
    batch_id: str | None = None

    def __post_init__(self) -> None:
        """Raises ValueError for a record the table cannot hold."""
        for name, length in _LENGTHS.items():
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or len(value) > length or "\x00" in value
            ):
                # (PostgreSQL's text holds no NUL.)
                raise ValueError(f"usage {name}: a string of at most {length} characters")
        if not self.request_id or not self.tenant_id or not self.model:
            raise ValueError("usage request_id, tenant_id and model must not be empty")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= _MAX_TOKENS:
                raise ValueError(f"usage {name}: an integer in [0, {_MAX_TOKENS}]")
        if self.status not in USAGE_STATUSES:
            raise ValueError(f"usage status: one of {', '.join(USAGE_STATUSES)}")
        for name in ("ttft", "latency"):
            value = getattr(self, name)
            if (value is not None or name == "latency") and not (
                isinstance(value, int | float) and math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"usage {name}: a finite number of seconds >= 0")
        if self.created_at.tzinfo is None:
            raise ValueError("usage created_at: a timezone-aware datetime")
        self.created_at = self.created_at.astimezone(UTC)

    @property
    def created_epoch(self) -> int:
        return math.floor(self.created_at.timestamp())

    def to_json(self) -> str:
        """One line of JSON (no newline: control characters are escaped)."""
        values = {name: getattr(self, name) for name in _NAMES}
        values["created_at"] = self.created_at.isoformat()
        return _ENCODER.encode(values)

    @classmethod
    def from_json(cls, line: str | bytes) -> UsageRecord:
        """Raises ValueError for anything but a record's line."""
        data = json.loads(line)
        if not isinstance(data, dict) or not _REQUIRED <= set(data) <= _FIELDS:
            raise ValueError("not a usage record")
        data["created_at"] = datetime.fromisoformat(data["created_at"])
        return cls(**data)

    def row(self) -> dict[str, Any]:
        # (Not dataclasses.asdict: it deep-copies every value, 20x slower.)
        values = {name: getattr(self, name) for name in _NAMES}
        values["created_epoch"] = self.created_epoch
        return values


_NAMES = tuple(f.name for f in fields(UsageRecord))
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # one, not one per json.dumps call
_FIELDS = set(_NAMES)
# What every line has; the rest (fields added since) a line from an older process may lack.
_REQUIRED = {f.name for f in fields(UsageRecord) if f.default is MISSING}


class Ledger:
    def __init__(
        self,
        db: Database,
        spool_dir: Path,
        *,
        flush_interval: float = 0.5,
        batch_size: int = 500,
    ) -> None:
        self.db = db
        self.spool = Spool(spool_dir)
        self.flush_interval = flush_interval
        self.batch_size = batch_size
        self.num_spooled = 0  # records durable in the spool
        self.num_written = 0  # rows inserted (or found there already) from drained segments
        self.num_db_errors = 0  # failed attempts to write a batch
        self.num_rejected = 0  # lines no database would take, set aside in rejected/
        self._pending = 0  # records accepted, or found in adopted segments, not yet in the DB
        self._queue: list[tuple[str, asyncio.Future[None] | None]] = []
        self._committer: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_lock: asyncio.Lock | None = None
        self._held: list[Segment] = []  # sealed or adopted, locked, to drain
        self._outage_since: float | None = None
        # Appends have a thread of their own: a request's fdatasync never waits behind the
        # drain's reading and parsing, nor behind other work of the loop's default executor.
        self._append_io = ThreadPoolExecutor(1, thread_name_prefix="usage-spool")
        self._drain_io = ThreadPoolExecutor(1, thread_name_prefix="usage-drain")
        dialect = {"postgresql": postgresql, "sqlite": sqlite}[db.engine.dialect.name]
        self._insert = dialect.insert(Usage.__table__).on_conflict_do_nothing(
            index_elements=["request_id"]
        )

    @property
    def num_pending(self) -> int:
        """Records in the queue or the spool, not yet in the database."""
        return self._pending

    # -- the request path ---------------------------------------------------------------------

    async def start(self) -> None:
        """Open this process's segment and start the writer, which first drains what earlier
        processes left. Call from the event loop that serves (the database's connections
        belong to it)."""
        if self._writer is not None and not self._writer.done():
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._drain_lock = asyncio.Lock()
        await self._run_drain(self.spool.open)
        self._writer = self._loop.create_task(self._run(), name="usage-ledger")

    async def record(self, record: UsageRecord) -> None:
        """Return once the record is durable in the spool. Every record waiting meanwhile
        shares the next write+fdatasync. Cancelling the caller does not withdraw the record.
        Raises OSError when the spool cannot be written."""
        future = asyncio.get_running_loop().create_future()
        self._enqueue(record, future)
        await asyncio.shield(future)

    def record_nowait(self, record: UsageRecord) -> None:
        """Queue the record for the next group commit without waiting for it (a cancelled
        stream's cleanup). Outside an event loop it is written here and now."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.spool.append([record.to_json()])
            self.num_spooled += 1
            self._pending += 1
            return
        self._enqueue(record, None)

    def _enqueue(self, record: UsageRecord, future: asyncio.Future[None] | None) -> None:
        self._queue.append((record.to_json(), future))
        self._pending += 1
        loop = asyncio.get_running_loop()
        if self._committer is None or self._committer.done() or self._committer.get_loop() != loop:
            self._committer = loop.create_task(self._commit())

    async def _commit(self) -> None:
        """Group commit: whatever queued while the last write+fdatasync ran goes in the next
        one. No timer: a lone record is written at once."""
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await self._run_append(self.spool.append, [line for line, _ in batch])
            except OSError as exc:
                self._pending -= len(batch)
                logger.error(
                    "usage spool %s: %d records not written: %s",
                    self.spool.directory,
                    len(batch),
                    exc,
                )
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(exc)
                continue
            self.num_spooled += len(batch)
            for _, future in batch:
                if future is not None and not future.done():
                    future.set_result(None)
            active = self.spool.active
            if active is not None and active.num_rows >= self.batch_size:
                self._wake_writer()

    def _wake_writer(self) -> None:
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run_append(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._append_io, fn, *args)

    async def _run_drain(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._drain_io, fn, *args)

    # -- the writer -----------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None
        delay = 0.0
        while True:
            ok = await self._drain()
            delay = 0.0 if ok else min(MAX_BACKOFF, max(self.flush_interval, 2 * delay))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay or self.flush_interval)
            self._wake.clear()

    async def _drain(self) -> bool:
        """One pass: adopt what nobody holds, drain what this process holds, then seal the
        active segment and drain it. False when the database failed (the rest waits)."""
        assert self._drain_lock is not None
        async with self._drain_lock:
            skip = {s.path for s in self._held}
            adopted = await self._run_drain(self.spool.adopt, skip, MAX_ADOPTED)
            for segment in adopted:
                self._pending += segment.num_rows
            self._held += adopted
            # While a backlog waits for the database the active segment keeps growing, rather
            # than sealing (and holding open) one more file per interval.
            if not await self._drain_held():
                return False
            self._held += await self._run_drain(self.spool.seal)
            return await self._drain_held()

    async def _drain_held(self) -> bool:
        while self._held:
            segment = self._held[0]
            try:
                await self._write_segment(segment)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any database failure: retried later
                self.num_db_errors += 1
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    logger.warning(
                        "usage ledger: cannot write to the database (%s: %s); %d rows wait in "
                        "%s and are retried",
                        type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "",
                        self._pending,
                        self.spool.directory,
                    )
                return False
            await self._run_drain(segment.remove)
            self._held.pop(0)
            self._pending -= segment.num_rows
            if self._outage_since is not None:
                logger.warning(
                    "usage ledger: the database takes rows again after %.1f s",
                    time.monotonic() - self._outage_since,
                )
                self._outage_since = None
        return True

    async def _write_segment(self, segment: Segment) -> None:
        lines = segment.lines()

        def parse() -> asyncio.Future[tuple[list[dict[str, Any]], list[bytes], bool]]:
            return asyncio.ensure_future(
                self._run_drain(_parse_batch, lines, self.batch_size, segment)
            )

        # The next batch is parsed (in the drain thread) while this one is inserted.
        upcoming: asyncio.Future[Any] | None = parse()
        try:
            while upcoming is not None:
                rows, bad, done = await upcoming
                upcoming = None if done else parse()
                if rows:
                    try:
                        await self._insert_rows(rows)
                    except _Rejected as exc:
                        rows = [row for row in rows if row not in exc.rows]
                        bad += [json.dumps(row, default=str).encode() for row in exc.rows]
                    self.num_written += len(rows)
                if bad:
                    await self._run_drain(self._reject, bad, segment)
        finally:
            if upcoming is not None:
                with contextlib.suppress(Exception):
                    await upcoming
            await self._run_drain(lines.close)

    async def _insert_rows(self, rows: list[dict[str, Any]]) -> None:
        try:
            async with self.db.engine.begin() as conn:
                await conn.execute(self._insert, rows)
        except (DataError, IntegrityError):
            if len(rows) == 1:
                raise _Rejected(rows) from None
            # A row this database refuses (not a lost connection): find it by halves, set it
            # aside, and write the others.
            half = len(rows) // 2
            refused: list[dict[str, Any]] = []
            for part in (rows[:half], rows[half:]):
                try:
                    await self._insert_rows(part)
                except _Rejected as exc:
                    refused += exc.rows
            if refused:
                raise _Rejected(refused) from None

    def _reject(self, lines: list[bytes], segment: Segment) -> None:
        """Keep lines no database takes in rejected/ (never silently dropped)."""
        path = self.spool.directory / "rejected" / segment.path.name
        path.parent.mkdir(exist_ok=True)
        with path.open("ab") as f:
            f.writelines(line + b"\n" for line in lines)
        self.num_rejected += len(lines)
        logger.error("usage ledger: %d lines no database takes set aside in %s", len(lines), path)

    # -- tests and shutdown ---------------------------------------------------------------------

    async def flush(self, timeout: float | None = None) -> bool:
        """Drain until every record this ledger accepted (and every segment it could adopt)
        is in the database: True, or False once `timeout` seconds have passed."""

        async def drain() -> bool:
            delay = 0.01
            while True:
                if self._committer is not None and not self._committer.done():
                    await asyncio.shield(self._committer)
                if await self._drain() and not self._queue and self._pending == 0:
                    return True
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)

        if self._drain_lock is None:
            self._drain_lock = asyncio.Lock()
        try:
            return await asyncio.wait_for(drain(), timeout)
        except TimeoutError:
            return False

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Spool what is queued, try the database once more (for at most `timeout` seconds),
        stop the writer. What is still in the spool then stays there for the next start."""
        if self._committer is not None and not self._committer.done():
            await asyncio.shield(self._committer)
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        if not await self.flush(timeout):
            logger.warning(
                "usage ledger: %d rows stay in %s for the next start",
                self._pending,
                self.spool.directory,
            )
        for segment in self._held:
            await self._run_drain(segment.release)
        self._held.clear()
        await self._run_drain(self.spool.close)
        self._pending = 0  # what stays is the next process's to count
        self._loop = self._wake = self._drain_lock = None


class _Rejected(Exception):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows


def _parse_batch(
    lines: Generator[tuple[int, bytes, bool]], size: int, segment: Segment
) -> tuple[list[dict[str, Any]], list[bytes], bool]:
    """Up to `size` rows from the segment's line iterator: (rows, unreadable lines, at end?).
    An incomplete last line is a write cut short by a crash: skipped, as nobody was told it
    was written."""
    rows: list[dict[str, Any]] = []
    bad: list[bytes] = []
    for number, line, complete in lines:
        if not complete:
            if not segment.torn_warned:
                segment.torn_warned = True
                logger.warning("usage spool %s: skipped a torn last line", segment.path.name)
            continue
        try:
            rows.append(UsageRecord.from_json(line).row())
        except (ValueError, TypeError) as exc:
            logger.error("usage spool %s line %d: %s", segment.path.name, number, exc)
            bad.append(line)
        if len(rows) >= size:
            return rows, bad, False
    return rows, bad, True
