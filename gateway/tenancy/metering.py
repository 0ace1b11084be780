"""One request's usage row, built as it ends, however it ends.

A request that reached the engine gets exactly one row in the usage ledger: finished, stopped
by the client mid-stream (the tokens generated so far are billed), failed in a step, or
cancelled. `Meter.end` appends the row to the durable spool and waits for it (the response's
last bytes go out after), then hands the limiter its reservation back with the tokens used.
`Meter.end_nowait` does the same where nothing can wait any more: a client that went away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from engine.lora.types import LoRARequest
from gateway.metrics import TenantMetrics
from gateway.tenancy.admission import Ticket
from gateway.tenancy.auth import RequestTenant
from tenants.ledger import UsageRecord

STATUS_OK, STATUS_ABORTED, STATUS_ERROR = "ok", "aborted", "error"


class UsageSink(Protocol):
    """Where usage rows go: the tenants' ledger (tenants.ledger.Ledger), or nowhere on a
    server whose gateway in front keeps the usage (`loragate engine`)."""

    async def record(self, record: UsageRecord) -> None:
        """Return once the row is durable."""
        ...

    def record_nowait(self, record: UsageRecord) -> None:
        """Queue the row without waiting for it (a cancelled response's cleanup)."""
        ...


@dataclass(frozen=True, slots=True)
class UsageFigures:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Meter:
    ledger: UsageSink
    ticket: Ticket
    metrics: TenantMetrics
    tenant: RequestTenant
    request_id: str
    model: str  # the base model
    # The adapter as the tenant named it (its `model` field), and the engine's view of it.
    adapter_name: str | None
    lora: LoRARequest | None
    start: float  # time.monotonic() when the request arrived
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    ttft: float | None = None
    ended: bool = False
    # The API the request came through, on its usage row (last: the fields before it are
    # passed by position).
    endpoint: str | None = None

    def first_token(self, decode_time: float = 0.0) -> None:
        """The first update arrived; `decode_time`: how long before it its first token was
        made (a FINAL_ONLY update's, engine.request.OutputKind)."""
        if self.ttft is None:
            self.ttft = max(0.0, time.monotonic() - self.start - decode_time)

    async def end(self, figures: UsageFigures, finish_reason: str | None, status: str) -> None:
        """Durable when this returns (spooled and fsynced). The reservation is released in
        the background: the response need not wait for the limiter's round trip."""
        if self.ended:
            return
        self.ended = True
        try:
            await self.ledger.record(self._row(figures, finish_reason, status))
        finally:
            self.ticket.release(figures.total)

    def end_nowait(self, figures: UsageFigures, finish_reason: str | None, status: str) -> None:
        """For a request whose task cannot wait: the row joins the next group commit."""
        if self.ended:
            return
        self.ended = True
        try:
            self.ledger.record_nowait(self._row(figures, finish_reason, status))
        finally:
            self.ticket.release(figures.total)

    def _row(self, figures: UsageFigures, finish_reason: str | None, status: str) -> UsageRecord:
        record = UsageRecord(
            request_id=self.request_id,
            tenant_id=self.tenant.id,
            key_id=self.tenant.key_id,
            model=self.model,
            adapter_name=self.adapter_name,
            adapter_sha256=None if self.lora is None else self.lora.adapter_id,
            prompt_tokens=figures.prompt_tokens,
            cached_tokens=figures.cached_tokens,
            completion_tokens=figures.completion_tokens,
            finish_reason=finish_reason,
            status=status,
            ttft=self.ttft,
            latency=time.monotonic() - self.start,
            created_at=self.created_at,
            endpoint=self.endpoint,
        )
        self.metrics.observe(record)
        return record
