"""Files of the Files API (`/v1/files`), per tenant: the bytes on disk, a row each in `files`.

The bytes live under `root` (the adapter store's directory + `files/`: a local directory, or
the shared volume every gateway mounts on Kubernetes):

    <root>/<tenant_id>/<file_id>   a file's bytes, written once and never changed
    <root>/.incoming/<random>      bytes being written, before they are a file

A file is written whole under `.incoming`, fsync'd, renamed into its tenant's directory (the
directory fsync'd), and only then does its row go in, in the same transaction that checked the
tenant's cap: a row always names complete bytes. Deleting removes the row, then the bytes (a
reader that has the file open reads on). A crash between the two steps leaves bytes no row
names, which `sweep` removes once they are older than SWEEP_GRACE (younger ones may be another
gateway's upload between its rename and its row).

Every read is scoped to a tenant: another tenant's file id reads as one that does not exist.
Purposes are OpenAI's: `batch` for what clients upload (the only purpose the cap refuses),
`batch_output` for what a batch writes (results and errors), which counts toward the cap but
is never refused by it: a batch that has run must be able to leave its results.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Literal, cast

from sqlalchemy import CursorResult, delete, func, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.db import Database
from tenants.models import FileRow, Tenant, utcnow

PURPOSES = ("batch", "batch_output")
UPLOAD_PURPOSES = frozenset({"batch"})  # what the cap refuses
MAX_FILENAME_CHARS = 255  # the column's
MAX_PAGE = 10_000  # OpenAI's largest `limit`
SWEEP_GRACE = 3600.0  # seconds: bytes without a row younger than this may be an upload in flight
READ_BLOCK = 1 << 20  # bytes of lines read per trip to a thread
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class TooManyFiles(Exception):
    """The tenant holds max_per_tenant files already."""

    def __init__(self, max_per_tenant: int) -> None:
        super().__init__(
            f"this tenant holds {max_per_tenant} files, as many as it may: delete some first"
        )
        self.max_per_tenant = max_per_tenant


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A stored file: its row, and where its bytes are (`path`, on this machine)."""

    id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    num_lines: int  # as `lines` yields them: a last line without its newline counts
    created_at: datetime  # timezone-aware UTC
    path: Path


@dataclass(frozen=True, slots=True)
class FilePage:
    files: list[FileRecord]
    has_more: bool


def new_file_id() -> str:
    return f"file-{secrets.token_hex(16)}"


class FileStore:
    """The `files` table and the bytes under `root`; one session per call, file work in threads."""

    def __init__(self, db: Database, root: Path, *, max_per_tenant: int) -> None:
        if max_per_tenant < 1:
            raise ValueError("files per tenant: at least 1")
        self.db = db
        self.root = Path(root).resolve()
        self.max_per_tenant = max_per_tenant
        self._incoming = self.root / ".incoming"  # made by the first upload

    def path(self, tenant_id: str, file_id: str) -> Path:
        """Where a file's bytes are; ValueError for a name that could leave `root`."""
        if not (_SAFE_NAME.fullmatch(tenant_id) and _SAFE_NAME.fullmatch(file_id)):
            raise ValueError("not a tenant id and a file id")
        return self.root / tenant_id / file_id

    # -- writing ------------------------------------------------------------------------------

    def staging(self) -> Path:
        """A new path to write a file's bytes to (not created), for `commit`: on the same
        filesystem as the files, so that committing is a rename."""
        self._incoming.mkdir(parents=True, exist_ok=True)
        return self._incoming / secrets.token_hex(16)

    def discard(self, staged: Path) -> None:
        staged.unlink(missing_ok=True)

    async def create(self, tenant_id: str, purpose: str, filename: str, data: bytes) -> FileRecord:
        """Store `data` as a new file of the tenant's. Raises as `commit` does."""
        staged = self.staging()
        try:
            await asyncio.to_thread(staged.write_bytes, data)
        except BaseException:
            self.discard(staged)
            raise
        return await self.commit(tenant_id, purpose, filename, staged)

    async def commit(self, tenant_id: str, purpose: str, filename: str, staged: Path) -> FileRecord:
        """Store the bytes written to `staged` (a `staging()` path) as a new file of the
        tenant's: fsync'd, renamed into place, then its row. The staged path is gone after,
        whatever happens. Raises TooManyFiles (an upload purpose, the tenant at its cap),
        LookupError for a tenant that does not exist, ValueError for a purpose not in PURPOSES
        or a filename over MAX_FILENAME_CHARS."""
        try:
            _check_fields(purpose, filename)
            size, num_lines = await asyncio.to_thread(_sync_and_count, staged)
        except BaseException:
            self.discard(staged)
            raise
        file_id = new_file_id()
        final = self.path(tenant_id, file_id)
        record = FileRecord(file_id, tenant_id, purpose, filename, size, num_lines, utcnow(), final)
        try:
            async with self.db.session() as session, session.begin():
                held = await _hold_tenant(session, tenant_id)
                if purpose in UPLOAD_PURPOSES and held >= self.max_per_tenant:
                    raise TooManyFiles(self.max_per_tenant)
                await asyncio.to_thread(_place, staged, final)
                session.add(
                    FileRow(
                        id=record.id,
                        tenant_id=tenant_id,
                        purpose=purpose,
                        filename=filename,
                        num_bytes=size,
                        num_lines=num_lines,
                        created_at=record.created_at,
                    )
                )
        except BaseException:
            self.discard(staged)
            final.unlink(missing_ok=True)
            raise
        return record

    # -- reading ------------------------------------------------------------------------------

    async def get(self, tenant_id: str, file_id: str) -> FileRecord | None:
        """None for an unknown id, or another tenant's."""
        async with self.db.session() as session:
            row = await session.scalar(
                select(FileRow).where(FileRow.id == file_id, FileRow.tenant_id == tenant_id)
            )
        return None if row is None else self._record(row)

    async def read(self, tenant_id: str, file_id: str) -> bytes | None:
        """The whole file; None where `get` answers None (or the file was deleted meanwhile).
        For a large file, `lines` or `open`."""
        record = await self.get(tenant_id, file_id)
        if record is None:
            return None
        try:
            return await asyncio.to_thread(record.path.read_bytes)
        except FileNotFoundError:
            return None

    async def open(self, tenant_id: str, file_id: str) -> tuple[FileRecord, IO[bytes]] | None:
        """The record and its bytes opened for reading (a delete meanwhile does not cut the
        reader off); None where `get` answers None. The caller closes it."""
        record = await self.get(tenant_id, file_id)
        if record is None:
            return None
        try:
            return record, await asyncio.to_thread(record.path.open, "rb")
        except FileNotFoundError:
            return None

    def lines(
        self, record: FileRecord, *, max_line_bytes: int | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """The file's lines, as `read_lines` gives them."""
        return read_lines(record.path, max_line_bytes=max_line_bytes)

    async def count(self, tenant_id: str) -> int:
        async with self.db.session() as session:
            return await _count(session, tenant_id)

    async def list(
        self,
        tenant_id: str,
        *,
        purpose: str | None = None,
        limit: int = MAX_PAGE,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> FilePage:
        """At most `limit` of the tenant's files (of `purpose`, if given), by creation in
        `order`, from the one after the file `after` (keyset: a file made or deleted meanwhile
        shifts no page; an id the tenant does not hold: an empty page)."""
        row = FileRow
        query = select(row).where(row.tenant_id == tenant_id)
        if purpose is not None:
            query = query.where(row.purpose == purpose)
        async with self.db.session() as session:
            if after is not None:
                # PostgreSQL refuses a string with a NUL outright; no file id holds one anyway.
                cursor = None if "\x00" in after else await session.get(row, after)
                if cursor is None or cursor.tenant_id != tenant_id:
                    return FilePage([], has_more=False)
                key, position = tuple_(row.created_at, row.id), tuple_(cursor.created_at, cursor.id)
                query = query.where(key > position if order == "asc" else key < position)
            ordering = (
                (row.created_at.asc(), row.id.asc())
                if order == "asc"
                else (row.created_at.desc(), row.id.desc())
            )
            rows = list(await session.scalars(query.order_by(*ordering).limit(limit + 1)))
        return FilePage([self._record(r) for r in rows[:limit]], has_more=len(rows) > limit)

    # -- deleting -----------------------------------------------------------------------------

    async def delete(self, tenant_id: str, file_id: str) -> bool:
        """The row, then the bytes; False where `get` answers None."""
        async with self.db.session() as session, session.begin():
            deleted = await session.execute(
                delete(FileRow)
                .where(FileRow.id == file_id, FileRow.tenant_id == tenant_id)
                .execution_options(synchronize_session=False)
            )
        if not cast(CursorResult[Any], deleted).rowcount:
            return False
        await asyncio.to_thread(self.path(tenant_id, file_id).unlink, missing_ok=True)
        return True

    async def remove_tenant(self, tenant_id: str) -> None:
        """A deleted tenant's bytes (its rows went with it: tenants.tenants.delete_tenant)."""
        if _SAFE_NAME.fullmatch(tenant_id):
            await asyncio.to_thread(shutil.rmtree, self.root / tenant_id, ignore_errors=True)

    async def sweep(self, grace: float = SWEEP_GRACE) -> int:
        """Remove bytes no row names (a crash between a file's two steps, a tenant deleted
        while its gateway stopped) and staged bytes, each once older than `grace` seconds;
        how many files went."""
        removed = 0
        cutoff = time.time() - grace
        async with self.db.session() as session:
            tenants = set(await session.scalars(select(Tenant.id)))
            for directory in await asyncio.to_thread(_directories, self.root):
                if directory.name not in tenants:
                    removed += await asyncio.to_thread(_remove_old, directory, cutoff, None)
                    continue
                held = set(
                    await session.scalars(
                        select(FileRow.id).where(FileRow.tenant_id == directory.name)
                    )
                )
                removed += await asyncio.to_thread(_remove_old, directory, cutoff, held)
        removed += await asyncio.to_thread(_remove_old, self._incoming, cutoff, set())
        return removed

    def _record(self, row: FileRow) -> FileRecord:
        return FileRecord(
            id=row.id,
            tenant_id=row.tenant_id,
            purpose=row.purpose,
            filename=row.filename,
            bytes=row.num_bytes,
            num_lines=row.num_lines,
            created_at=row.created_at,
            path=self.path(row.tenant_id, row.id),
        )


async def read_lines(
    path: Path, *, max_line_bytes: int | None = None
) -> AsyncIterator[tuple[int, bytes]]:
    """(number from 1, line without its newline) for each line of the file at `path`, read in
    blocks in a thread: a file of any size streams through a bounded amount of memory. A line
    longer than `max_line_bytes` is cut to max_line_bytes + 1 bytes (the rest skipped unread
    into memory), so that the reader sees it is too long. A last line without a newline is a
    line; an empty file has none."""
    stream = await asyncio.to_thread(path.open, "rb")
    try:
        number = 0
        while block := await asyncio.to_thread(_read_block, stream, max_line_bytes):
            for line in block:
                number += 1
                yield number, line
    finally:
        stream.close()


def _read_block(stream: IO[bytes], max_line_bytes: int | None) -> list[bytes]:
    block: list[bytes] = []
    taken = 0
    while taken < READ_BLOCK:
        line = stream.readline(-1 if max_line_bytes is None else max_line_bytes + 1)
        if not line:
            break
        taken += len(line)
        if line.endswith(b"\n"):
            line = line[:-1]
        elif max_line_bytes is not None and len(line) > max_line_bytes:
            while (rest := stream.readline(READ_BLOCK)) and not rest.endswith(b"\n"):
                pass
        block.append(line)
    return block


def _check_fields(purpose: str, filename: str) -> None:
    if purpose not in PURPOSES:
        raise ValueError(f"purpose: one of {', '.join(PURPOSES)}, not {purpose!r}")
    if not 0 < len(filename) <= MAX_FILENAME_CHARS:
        raise ValueError(f"a file name has 1 to {MAX_FILENAME_CHARS} characters")


async def _hold_tenant(session: AsyncSession, tenant_id: str) -> int:
    """How many files the tenant holds, counted under a write to its row (that changes
    nothing): a row lock on PostgreSQL, SQLite's one writer's lock there, so that two uploads
    at the cap are counted one after the other. LookupError for a tenant that does not exist."""
    held = await session.execute(
        update(Tenant)
        .where(Tenant.id == tenant_id)
        .values(id=Tenant.id)
        .execution_options(synchronize_session=False)
    )
    if not cast(CursorResult[Any], held).rowcount:
        raise LookupError(f"no tenant {tenant_id!r}")
    return await _count(session, tenant_id)


async def _count(session: AsyncSession, tenant_id: str) -> int:
    held = await session.scalar(select(func.count()).where(FileRow.tenant_id == tenant_id))
    return int(held or 0)


def _sync_and_count(staged: Path) -> tuple[int, int]:
    """The staged bytes made durable; their size and number of lines."""
    size = num_lines = 0
    last = b"\n"
    with staged.open("rb") as stream:
        while chunk := stream.read(READ_BLOCK):
            size += len(chunk)
            num_lines += chunk.count(b"\n")
            last = chunk[-1:]
        os.fsync(stream.fileno())
    return size, num_lines + (last != b"\n")


def _place(staged: Path, final: Path) -> None:
    """Rename the staged bytes into place and make the rename durable."""
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)
    descriptor = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _directories(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and _SAFE_NAME.fullmatch(p.name)]


def _remove_old(directory: Path, cutoff: float, keep: set[str] | None) -> int:
    """Remove the files of `directory` not in `keep` last written before `cutoff`; `keep`
    None: the whole directory once nothing in it is younger. How many files went."""
    removed = 0
    if not directory.is_dir():
        return 0
    for entry in list(directory.iterdir()):
        try:
            old = entry.stat().st_mtime < cutoff
        except FileNotFoundError:
            continue
        if old and entry.is_file() and (keep is None or entry.name not in keep):
            entry.unlink(missing_ok=True)
            removed += 1
    if keep is None and not any(directory.iterdir()):
        directory.rmdir()
    return removed
