"""Finished batch lines written in groups: every line that finished while the last group was
being written goes in the next one, one transaction (one commit, one fsync) for all of them,
as the usage ledger commits its rows. Each line's answer and usage row are still written only
while its claim holds (tenants.batch_lines.LineClaims.finish_many), so a group changes the
cost of exactly once, not its guarantee."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tenants.batch_lines import LineAnswer, LineClaims, LineKey

logger = logging.getLogger(__name__)

WRITE_RETRIES = (0.5, 2.0, 5.0)  # seconds between tries of a group's write
MAX_GROUP = 256  # lines in one transaction, at most


class LineWriter:
    def __init__(self, claims: LineClaims, worker: str) -> None:
        self.claims = claims
        self.worker = worker
        self.num_groups = 0  # transactions written
        self._pending: list[tuple[LineKey, LineAnswer, asyncio.Future[bool]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def write(self, key: LineKey, answer: LineAnswer) -> bool:
        """Write the line's answer with the next group: True once written, False if the
        claim was no longer this worker's; the database's error after the retries."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((key, answer, future))
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="batch-line-writer")
        self._wake.set()
        return await future

    async def close(self) -> None:
        """Stop; lines still waiting are not written (their claims lapse or are given back)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for _, _, future in self._pending:
            future.cancel()
        self._pending = []

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                group, self._pending = self._pending[:MAX_GROUP], self._pending[MAX_GROUP:]
                try:
                    written = await self._write([(key, answer) for key, answer, _ in group])
                except Exception as exc:  # noqa: BLE001 - each line's task hears of it
                    for _, _, future in group:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, _, future), took in zip(group, written, strict=True):
                    if not future.done():  # its task may have been cancelled meanwhile
                        future.set_result(took)

    async def _write(self, group: list[tuple[LineKey, LineAnswer]]) -> list[bool]:
        for delay in (*WRITE_RETRIES, None):
            try:
                written = await self.claims.finish_many(self.worker, group)
                self.num_groups += 1
                return written
            except Exception:
                if delay is None:
                    raise
                logger.warning("writing %d batch lines failed; again", len(group))
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")
