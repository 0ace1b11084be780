"""The Batch API over the tenant's batches (tenants.batches.BatchStore) and files
(tenants.files.FileStore); the runner (gateway.openai.batches.runner) runs them.

Making a batch reads its input file (purpose `batch`) and checks every line again as its route
would now (gateway.openai.batch_lines.check_line: the tenant's models and adapters may have
changed since the upload), and that each line's `url` is the batch's `endpoint`: a file with
lines that cannot run is a 400 listing them by number, and no batch is made. Each line's
estimate is what its route would reserve (prompt + max_tokens); the tenant's unfinished
batches may hold at most its `batch_token_limit` of them (else the server's), past which a
new batch is a 429 `token_limit_exceeded`.

A batch is the tenant's alone: another tenant's batch id answers exactly as one that never
existed (404), on every route, and so does another tenant's file id.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gateway.http.errors import APIError
from gateway.http.request_limits import INVALID_VALUE
from gateway.openai.batch_lines import BatchLine, LineError, check_line
from gateway.openai.batches.protocol import (
    COMPLETION_WINDOW,
    BatchCreate,
    BatchFileRefused,
    batch_list,
    batch_object,
)
from gateway.openai.batches.runner import BatchRunner
from gateway.openai.files.serving import not_found as file_not_found
from gateway.openai.responses.serving import ResponsesServing
from gateway.openai.serving import OpenAIServing
from gateway.tenancy.auth import RequestTenant
from tenants.batches import BatchStore, LineTotals, NewLine, QueuedTokensExceeded, StoredBatch
from tenants.files import FileStore
from tenants.models import utcnow

UPLOAD_PURPOSE = "batch"


def not_found(batch_id: str) -> APIError:
    """The one answer for a batch that does not exist, or is another tenant's."""
    return APIError(
        404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found"
    )


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(16)}"


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """The server's batch settings that making a batch reads."""

    completion_window: float = 86400.0  # seconds "24h" means here
    token_limit: int | None = None  # a tenant's queued tokens without a cap of its own
    max_line_bytes: int | None = None  # a line's body: the server's request bodies' limit


class BatchesServing:
    def __init__(
        self,
        core: OpenAIServing,
        store: BatchStore,
        files: FileStore,
        policy: BatchPolicy,
        runner: BatchRunner | None = None,
        responses: ResponsesServing | None = None,
    ) -> None:
        self.core = core
        self.store = store
        self.files = files
        self.policy = policy
        self.runner = runner  # None: batches are made and read, and run elsewhere
        self.responses = responses

    async def create(self, body: BatchCreate, tenant: RequestTenant) -> dict[str, Any]:
        record = await self.files.get(tenant.id, body.input_file_id)
        if record is None:
            raise _input_not_found(body.input_file_id)
        if record.purpose != UPLOAD_PURPOSE:
            raise APIError(
                400,
                f"input_file_id: file {record.id} has purpose {record.purpose!r}; a batch "
                f"reads a file uploaded with purpose {UPLOAD_PURPOSE!r}",
                param="input_file_id",
                code=INVALID_VALUE,
            )
        lines = await self._lines(record.id, tenant, body.endpoint)
        now = utcnow()
        made = StoredBatch(
            id=new_batch_id(),
            tenant_id=tenant.id,
            key_id=tenant.key_id,
            endpoint=body.endpoint,
            input_file_id=record.id,
            completion_window=COMPLETION_WINDOW,
            status="in_progress",
            metadata=dict(body.metadata or {}),
            output_file_id=None,
            error_file_id=None,
            totals=LineTotals(total=len(lines)),
            created_at=now,
            expires_at=now + timedelta(seconds=self.policy.completion_window),
        )
        limit = tenant.batch_token_limit
        if limit is None:
            limit = self.policy.token_limit
        try:
            batch = await self.store.create(made, lines, limit)
        except QueuedTokensExceeded as exc:
            raise _over_limit(tenant, exc) from exc
        if self.runner is not None:
            self.runner.wake()
        return batch_object(batch)

    async def _lines(self, file_id: str, tenant: RequestTenant, endpoint: str) -> list[NewLine]:
        """The file's lines, each checked as its route would check it now and against the
        batch's endpoint; raises BatchFileRefused listing the first bad ones."""
        opened = await self.files.get(tenant.id, file_id)
        if opened is None:  # deleted meanwhile
            raise _input_not_found(file_id)
        lines: list[NewLine] = []
        errors: list[LineError] = []
        num_bad = 0
        max_bytes = self.policy.max_line_bytes
        async for number, raw in self.files.lines(opened, max_line_bytes=max_bytes):
            checked = await check_line(
                self.core, tenant, number, raw, responses=self.responses, max_line_bytes=max_bytes
            )
            if isinstance(checked, BatchLine) and checked.url != endpoint:
                checked = LineError(
                    number,
                    "invalid_url",
                    f"url {checked.url!r} is not the batch's endpoint {endpoint!r}: every line "
                    "of a batch goes to its endpoint",
                    "url",
                )
            if isinstance(checked, LineError):
                num_bad += 1
                errors.append(checked)
                continue
            lines.append(NewLine(number, checked.custom_id, checked.body, checked.tokens))
        if num_bad:
            raise BatchFileRefused(errors, num_bad)
        if not lines:
            raise APIError(
                400, "the input file has no requests", param="input_file_id", code=INVALID_VALUE
            )
        return lines

    async def retrieve(self, tenant: RequestTenant, batch_id: str) -> dict[str, Any]:
        batch = await self.store.get(tenant.id, batch_id)
        if batch is None:
            raise not_found(batch_id)
        return batch_object(batch)

    async def list(self, tenant: RequestTenant, limit: int, after: str | None) -> dict[str, Any]:
        batches, more = await self.store.page(tenant.id, limit, after)
        return batch_list(batches, more)

    async def cancel(self, tenant: RequestTenant, batch_id: str) -> dict[str, Any]:
        """`cancelling` at once; the runner aborts its lines and ends it `cancelled` with the
        lines that finished in its output file. One that ended already is answered as is."""
        batch = await self.store.cancel(tenant.id, batch_id)
        if batch is None:
            raise not_found(batch_id)
        if self.runner is not None:
            self.runner.wake()
        return batch_object(batch)


def _input_not_found(file_id: str) -> APIError:
    error = file_not_found(file_id)
    error.param = "input_file_id"
    return error


def _over_limit(tenant: RequestTenant, exc: QueuedTokensExceeded) -> APIError:
    return APIError(
        429,
        f"Enqueued token limit reached for tenant {tenant.name}. Limit: {exc.limit:,} enqueued "
        f"tokens; {exc.queued:,} are queued and this batch would add {exc.adding:,}. Please try "
        "again once some in_progress batches have been completed.",
        type="tokens",
        param="input_file_id",
        code="token_limit_exceeded",
    )
