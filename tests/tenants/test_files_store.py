"""tenants/files.py on SQLite and PostgreSQL: files written whole and read back byte for byte by
their tenant only, listed in pages both ways and by purpose, streamed line by line (a long line
cut, not read whole), the per-tenant cap refusing uploads but never a batch's output, deleted
(row and bytes), a tenant's deletion taking its rows and its bytes, and the sweep of bytes no
row names."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tenants.db import Database, upgrade
from tenants.files import FileRecord, FileStore, TooManyFiles, read_lines
from tenants.models import FileRow
from tenants.tenants import create_tenant, delete_tenant, get_tenant

JSONL = b'{"custom_id": "a"}\n{"custom_id": "\xc3\xbc"}\n'


def run(
    database_url: str,
    root: Path,
    body: Callable[[FileStore, str, str], Awaitable[None]],
    *,
    max_per_tenant: int = 100,
) -> None:
    """Migrate, create two tenants, and run `body(store, tenant_a, tenant_b)`."""
    upgrade(database_url)

    async def main() -> None:
        db = Database(database_url)
        try:
            async with db.session() as session, session.begin():
                a = await create_tenant(session, name="acme")
                b = await create_tenant(session, name="bravo")
            store = FileStore(db, root / "files", max_per_tenant=max_per_tenant)
            await body(store, a.id, b.id)
        finally:
            await db.close()

    asyncio.run(main())


def ids(files: list[FileRecord]) -> list[str]:
    return [f.id for f in files]


def test_written_whole_and_read_by_its_tenant_only(database_url: str, tmp_path: Path) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        made = await store.create(a, "batch", "requests.jsonl", JSONL)
        assert made.id.startswith("file-") and len(made.id) == 5 + 32
        assert (made.tenant_id, made.purpose, made.filename) == (a, "batch", "requests.jsonl")
        assert (made.bytes, made.num_lines) == (len(JSONL), 2)
        assert made.created_at.tzinfo is not None
        assert made.path == tmp_path / "files" / a / made.id and made.path.read_bytes() == JSONL
        assert list((tmp_path / "files" / ".incoming").iterdir()) == []  # renamed, not copied

        got = await store.get(a, made.id)
        assert got == made
        assert await store.read(a, made.id) == JSONL
        opened = await store.open(a, made.id)
        assert opened is not None and opened[0] == made
        with opened[1] as stream:
            assert stream.read() == JSONL

        # Another tenant's id is an unknown one, for every call.
        assert await store.get(b, made.id) is None
        assert await store.read(b, made.id) is None
        assert await store.open(b, made.id) is None
        assert (await store.list(b)).files == []
        assert (await store.list(b, after=made.id)).files == []
        assert not await store.delete(b, made.id)
        assert await store.read(a, made.id) == JSONL

        assert await store.delete(a, made.id)
        assert await store.get(a, made.id) is None and not made.path.exists()
        assert not await store.delete(a, made.id)  # once

    run(database_url, tmp_path, body)


def test_lines_end_without_a_newline_and_a_long_one_is_cut(
    database_url: str, tmp_path: Path
) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        data = b"one\n\ntwo\r\n" + b"x" * 5000 + b"\nlast"
        made = await store.create(a, "batch", "f.jsonl", data)
        assert made.num_lines == 5
        got = [(n, line) async for n, line in store.lines(made)]
        assert got == [(1, b"one"), (2, b""), (3, b"two\r"), (4, b"x" * 5000), (5, b"last")]
        cut = [(n, line) async for n, line in store.lines(made, max_line_bytes=100)]
        assert cut[3] == (4, b"x" * 101) and cut[4] == (5, b"last")  # the rest skipped

        empty = await store.create(a, "batch", "empty.jsonl", b"")
        assert (empty.bytes, empty.num_lines) == (0, 0)
        assert [line async for line in store.lines(empty)] == []
        ends = await store.create(a, "batch", "ends.jsonl", b"a\nb\n")
        assert ends.num_lines == 2
        assert [line async for _, line in store.lines(ends)] == [b"a", b"b"]

    run(database_url, tmp_path, body)


def test_lines_stream_a_large_file_in_blocks(tmp_path: Path) -> None:
    path = tmp_path / "large.jsonl"
    line = b'{"custom_id": "%d", "body": "' + b"y" * 900 + b'"}'
    path.write_bytes(b"\n".join(line % i for i in range(5000)) + b"\n")  # ~4.5 MiB

    async def main() -> list[tuple[int, bytes]]:
        return [item async for item in read_lines(path)]

    got = asyncio.run(main())
    assert [n for n, _ in got] == list(range(1, 5001))
    assert got[4321][1] == line % 4321


def test_pages_both_ways_and_by_purpose(database_url: str, tmp_path: Path) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        made = []
        for n in range(5):
            purpose = "batch_output" if n == 2 else "batch"
            made.append(await store.create(a, purpose, f"f{n}.jsonl", b"{}\n"))
        await store.create(b, "batch", "theirs.jsonl", b"{}\n")
        newest_first = ids(made[::-1])

        page = await store.list(a)
        assert ids(page.files) == newest_first and not page.has_more
        page = await store.list(a, limit=2)
        assert ids(page.files) == newest_first[:2] and page.has_more
        page = await store.list(a, limit=2, after=page.files[-1].id)
        assert ids(page.files) == newest_first[2:4] and page.has_more
        page = await store.list(a, limit=2, after=page.files[-1].id)
        assert ids(page.files) == newest_first[4:] and not page.has_more
        page = await store.list(a, order="asc", limit=3, after=made[0].id)
        assert ids(page.files) == ids(made[1:4]) and page.has_more
        page = await store.list(a, purpose="batch_output")
        assert ids(page.files) == [made[2].id]
        page = await store.list(a, purpose="batch", order="asc")
        assert ids(page.files) == ids(made[:2] + made[3:])
        assert (await store.list(a, after="file-unknown")).files == []
        assert (await store.list(a, after="file-\x00")).files == []
        assert await store.count(a) == 5 and await store.count(b) == 1

    run(database_url, tmp_path, body)


def test_the_cap_refuses_uploads_but_never_a_batchs_output(
    database_url: str, tmp_path: Path
) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        kept = [await store.create(a, "batch", f"f{n}", b"{}\n") for n in range(2)]
        with pytest.raises(TooManyFiles):
            await store.create(a, "batch", "third", b"{}\n")
        output = await store.create(a, "batch_output", "output.jsonl", b"{}\n")
        assert await store.count(a) == 3  # outputs count toward the cap
        assert await store.create(b, "batch", "theirs", b"{}\n")  # another tenant's own cap
        # Nothing of the refused upload stayed: no row, no bytes, nothing staged.
        assert sorted(p.name for p in (tmp_path / "files" / a).iterdir()) == sorted(
            ids([*kept, output])
        )
        assert list((tmp_path / "files" / ".incoming").iterdir()) == []
        assert await store.delete(a, kept[0].id) and await store.delete(a, output.id)
        assert await store.create(a, "batch", "now it fits", b"{}\n")

    run(database_url, tmp_path, body, max_per_tenant=2)


def test_concurrent_uploads_at_the_cap_take_one_place_each(
    database_url: str, tmp_path: Path
) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        results = await asyncio.gather(
            *(store.create(a, "batch", f"f{n}", b"{}\n") for n in range(6)),
            return_exceptions=True,
        )
        made = [r for r in results if isinstance(r, FileRecord)]
        refused = [r for r in results if isinstance(r, TooManyFiles)]
        assert (len(made), len(refused)) == (3, 3), results
        assert await store.count(a) == 3

    run(database_url, tmp_path, body, max_per_tenant=3)


def test_bad_fields_and_unknown_tenants_store_nothing(database_url: str, tmp_path: Path) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        with pytest.raises(ValueError, match="purpose"):
            await store.create(a, "fine-tune", "f", b"{}")
        with pytest.raises(ValueError, match="characters"):
            await store.create(a, "batch", "x" * 256, b"{}")
        with pytest.raises(LookupError):
            await store.create("ten_" + "0" * 24, "batch", "f", b"{}")
        with pytest.raises(ValueError):
            store.path("../elsewhere", "file-1")
        assert await store.count(a) == 0
        assert list((tmp_path / "files" / ".incoming").iterdir()) == []
        assert not (tmp_path / "files" / ("ten_" + "0" * 24)).exists() or not any(
            (tmp_path / "files" / ("ten_" + "0" * 24)).iterdir()
        )

    run(database_url, tmp_path, body)


def test_a_deleted_tenant_takes_its_rows_and_its_bytes(database_url: str, tmp_path: Path) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        await store.create(a, "batch", "a1", JSONL)
        await store.create(a, "batch_output", "a2", JSONL)
        theirs = await store.create(b, "batch", "b1", JSONL)
        async with store.db.session() as session, session.begin():
            tenant = await get_tenant(session, tenant_id=a)
            assert tenant is not None
            await delete_tenant(session, tenant=tenant)
        await store.remove_tenant(a)
        async with store.db.session() as session:
            assert list(await session.scalars(select(FileRow.tenant_id))) == [b]
        assert not (tmp_path / "files" / a).exists()
        assert await store.read(b, theirs.id) == JSONL

    run(database_url, tmp_path, body)


def test_the_sweep_removes_old_bytes_no_row_names(database_url: str, tmp_path: Path) -> None:
    async def body(store: FileStore, a: str, b: str) -> None:
        kept = await store.create(a, "batch", "kept", JSONL)
        root = tmp_path / "files"
        orphan = root / a / "file-orphan"  # renamed into place, its row never written
        orphan.write_bytes(JSONL)
        young = root / a / "file-young"  # another gateway's upload between its two steps
        young.write_bytes(JSONL)
        staged = root / ".incoming" / "halfway"
        staged.write_bytes(b"{")
        gone = root / "ten_gone"  # a tenant deleted while its gateway was stopped
        gone.mkdir()
        (gone / "file-x").write_bytes(JSONL)
        old = time.time() - 7200
        for path in (orphan, staged, gone / "file-x", kept.path):
            os.utime(path, (old, old))

        assert await store.sweep() == 3
        assert not orphan.exists() and not staged.exists() and not gone.exists()
        assert young.exists()  # younger than the grace
        assert await store.read(a, kept.id) == JSONL  # a row names it
        async with store.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(FileRow)) == 1

    run(database_url, tmp_path, body)
