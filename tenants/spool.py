"""A durable spool: JSON lines in segment files of one directory, shared by the processes that
name it.

Each process appends to one active segment, `usage-<pid>-<ns>-<seq>.jsonl`, which it holds
under an exclusive `flock` from before the file has its name (it is made as `.tmp`, locked,
then renamed), so no other process ever sees it unlocked. Sealing gives the process a fresh
active segment and hands it the old one, still locked, to drain; draining ends by unlinking
the segment and only then closing it. A segment nobody holds is one its process left behind
(it died, or closed with the database down): any process may adopt it by taking its lock.

    process A:  usage-A-1.jsonl (active, locked)   usage-A-0.jsonl (sealed, locked, draining)
    process B:  usage-B-7.jsonl (active, locked)
    dead C:     usage-C-3.jsonl (unlocked: whoever locks it first drains it)

A line is durable once `append` returns (write, then fdatasync). A crash mid-append can leave
a last line without its newline: readers skip it, as nobody was told it was written.

Every method is synchronous file I/O: callers run them off the event loop. `append`, `seal`
and `close` share a lock, so they may come from different threads.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX, SUFFIX = "usage-", ".jsonl"
_sync = getattr(os, "fdatasync", os.fsync)


@dataclass(slots=True)
class Segment:
    """A segment file this process holds locked: its active one, or one to drain."""

    path: Path
    fd: int
    num_rows: int = 0  # lines in it (counted on adoption; appended since, for our own)
    num_bytes: int = 0
    adopted: bool = False
    torn_warned: bool = field(default=False, repr=False)

    def lines(self) -> Generator[tuple[int, bytes, bool]]:
        """(line number, line without its newline, complete?) from the start; only the
        last may be incomplete."""
        with os.fdopen(os.dup(self.fd), "rb") as f:
            f.seek(0)
            for number, line in enumerate(f, 1):
                complete = line.endswith(b"\n")
                yield number, line.rstrip(b"\n"), complete

    def remove(self) -> None:
        """Unlink, then unlock: another process that opened the path meanwhile finds the
        inode unlinked once it gets the lock, and leaves it."""
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)

    def release(self) -> None:
        """Unlock and keep the file, for this or another process to adopt later."""
        os.close(self.fd)


class Spool:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.active: Segment | None = None
        self._cut: list[Segment] = []  # segments an append failed in: drained, never appended to
        self.num_syncs = 0  # write+fdatasync calls: one per group commit
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def open(self) -> None:
        with self._lock:
            if self.active is None:
                self.active = self._new_segment()

    def append(self, lines: list[str]) -> None:
        """Write the lines (JSON without newlines) and fdatasync: durable on return. On an
        error nothing of them counts: the partial write is cut off (if it can be) and later
        lines go to a fresh segment, so that no good line is ever glued to a torn one."""
        data = "".join(line + "\n" for line in lines).encode()
        with self._lock:
            if self.active is None:
                self.active = self._new_segment()
            segment = self.active
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(segment.fd, view) :]
                _sync(segment.fd)
            except OSError:
                self._discard_tail(segment)
                raise
            finally:
                self.num_syncs += 1
            segment.num_rows += len(lines)
            segment.num_bytes += len(data)

    def _discard_tail(self, segment: Segment) -> None:
        try:
            os.ftruncate(segment.fd, segment.num_bytes)
            _sync(segment.fd)
        except OSError:
            # Cannot cut it: seal it as it is (a torn line is skipped when drained, and
            # nothing more is appended after it).
            self.active = None
            self._cut.append(segment)

    def seal(self) -> list[Segment]:
        """The active segment, if it holds anything, to drain (still locked); appends go to a
        fresh one from now on."""
        # The next segment is made (a file and a directory sync) before appends are held up.
        active = self.active
        fresh = self._new_segment() if active is not None and active.num_rows else None
        with self._lock:
            sealed, self._cut = self._cut, []
            segment = self.active
            if segment is not None and segment.num_rows:
                sealed.append(segment)
                # (Appended to since the look above: made here, holding appends up, rarely.)
                self.active, fresh = fresh or self._new_segment(), None
            if fresh is not None:  # not needed after all: the active segment changed
                fresh.remove()
            return sealed

    def adopt(self, skip: set[Path], limit: int) -> list[Segment]:
        """Segments no process holds (up to `limit`), locked for this one, lines counted."""
        adopted: list[Segment] = []
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return adopted
        for name in names:
            path = self.directory / name
            if name.startswith(PREFIX) and name.endswith(".tmp"):
                _remove_stale(path)
                continue
            if len(adopted) >= limit or not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
                continue
            if path in skip or (self.active is not None and path == self.active.path):
                continue
            segment = _try_lock(path)
            if segment is not None:
                segment.num_rows = sum(1 for _ in segment.lines())
                adopted.append(segment)
        return adopted

    def close(self) -> None:
        """Give up the active segment: kept (unlocked, for a later adoption) when it holds
        anything, removed when empty."""
        with self._lock:
            segments, self._cut = self._cut, []
            segment, self.active = self.active, None
            if segment is not None and not segment.num_rows:
                segment.remove()
            elif segment is not None:
                segments.append(segment)
            for held in segments:
                held.release()

    def _new_segment(self) -> Segment:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{PREFIX}{os.getpid()}-{time.time_ns()}-{next(self._seq)}{SUFFIX}"
        path = self.directory / name
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, path)
            _sync_directory(self.directory)
        except OSError:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return Segment(path, fd)


def _try_lock(path: Path) -> Segment | None:
    """The segment at `path`, locked, or None: held by a process, or gone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Drained and unlinked between our open and our lock: not a segment any more.
        if os.fstat(fd).st_nlink == 0:
            raise BlockingIOError
    except OSError:
        os.close(fd)
        return None
    return Segment(path, fd, num_bytes=os.fstat(fd).st_size, adopted=True)


def _remove_stale(path: Path) -> None:
    """A `.tmp` nobody holds: a process died between making a segment and naming it, so it is
    empty. Only an old one: a fresh one may be about to be locked by its maker."""
    try:
        if os.stat(path).st_mtime > time.time() - 60:
            return
    except FileNotFoundError:
        return
    segment = _try_lock(path)
    if segment is not None:
        segment.remove()


def _sync_directory(directory: Path) -> None:
    """A new file's name is durable once its directory is synced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
