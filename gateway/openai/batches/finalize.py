"""A batch's ending, written once: its output file (the answered lines, in input order) and
error file (the refused lines, and an expired batch's unfinished ones with OpenAI's
`batch_expired`), stored with the tenant's files (purpose `batch_output`), then its counts,
token sums and last status.

The finalization is claimed first (tenants.batches.BatchStore.begin_finish: one gateway
wins); an expired or cancelled batch's unfinished lines are fenced before they are read, so
that no answer lands after its files are written. The files are written, then the batch ends
only if this finisher's claim still holds; otherwise (it took longer than the lease and
another finisher took over) its files are deleted again, and the other's stand.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gateway.openai.batches.lines import output_id
from tenants.batches import BatchStore, DueBatch, FinishedLine
from tenants.files import FileRecord, FileStore

logger = logging.getLogger(__name__)

OUTPUT_PURPOSE = "batch_output"
EXPIRED = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
WRITE_CHUNK = 500  # lines handed to the writing thread at a time


def error_line(batch_id: str, line: FinishedLine) -> dict[str, Any] | None:
    """The line as its batch's error file holds it, or None for one it does not hold."""
    if line.status == "failed":
        return line.result
    if line.status == "expired":
        batch_line = output_id(batch_id, line.line)
        return {"id": batch_line, "custom_id": line.custom_id, "response": None, "error": EXPIRED}
    return None


@dataclass(slots=True)
class _Staged:
    """One of the two files being written: its staged path, open, and its lines so far."""

    path: Path
    stream: IO[bytes] | None = None
    num_lines: int = 0
    pending: list[bytes] = field(default_factory=list)

    def write(self) -> None:
        if self.stream is None:
            self.stream = self.path.open("wb")
        self.stream.writelines(self.pending)
        self.pending.clear()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


class Finisher:
    """Finalizes the batches that are due, as `finisher` (this gateway's runner)."""

    def __init__(self, store: BatchStore, files: FileStore, finisher: str, lease: float) -> None:
        self.store = store
        self.files = files
        self.finisher = finisher
        self.lease = lease

    async def finish_due(self) -> list[DueBatch]:
        """Every batch due now that this finisher could claim, ended; those it ended."""
        ended = []
        for due in await self.store.due():
            try:
                if await self.finish(due):
                    ended.append(due)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - its claim lapses and it is finalized again
                logger.exception("finalizing batch %s failed", due.id)
        return ended

    async def finish(self, due: DueBatch) -> bool:
        """End the batch as `due` says, unless another finisher holds it (False)."""
        if not await self.store.begin_finish(due, self.finisher, self.lease):
            return False
        if due.ending != "completed":
            await self.store.fence_lines(due.id, due.ending)
        output, errors = await self._write(due)
        totals = await self.store.totals(due.id)
        ended = await self.store.end_finish(
            due.id,
            self.finisher,
            due.ending,
            totals,
            None if output is None else output.id,
            None if errors is None else errors.id,
        )
        if not ended:
            for record in (output, errors):
                if record is not None:
                    await self.files.delete(due.tenant_id, record.id)
            return False
        logger.info(
            "batch %s %s: %d answered, %d failed of %d",
            due.id,
            due.ending,
            totals.completed,
            totals.failed,
            totals.total,
        )
        return True

    async def _write(self, due: DueBatch) -> tuple[FileRecord | None, FileRecord | None]:
        """The output and error files (None for one without lines), from the lines in order."""
        output, errors = _Staged(self.files.staging()), _Staged(self.files.staging())
        try:
            async for line in self.store.lines(due.id):
                if line.status == "done" and line.result is not None:
                    output.pending.append(_ENCODE(line.result).encode() + b"\n")
                    output.num_lines += 1
                elif (found := error_line(due.id, line)) is not None:
                    errors.pending.append(_ENCODE(found).encode() + b"\n")
                    errors.num_lines += 1
                for staged in (output, errors):
                    if len(staged.pending) >= WRITE_CHUNK:
                        await asyncio.to_thread(staged.write)
            for staged in (output, errors):
                if staged.num_lines:
                    await asyncio.to_thread(staged.write)
        finally:
            for staged in (output, errors):
                await asyncio.to_thread(staged.close)
        records: list[FileRecord | None] = []
        for staged, name in ((output, "output"), (errors, "error")):
            if not staged.num_lines:
                self.files.discard(staged.path)
                records.append(None)
                continue
            filename = f"{due.id}_{name}.jsonl"
            records.append(
                await self.files.commit(due.tenant_id, OUTPUT_PURPOSE, filename, staged.path)
            )
        return records[0], records[1]
