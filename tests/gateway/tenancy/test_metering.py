"""gateway/tenancy/metering.py alone, against a real ledger (SQLite and PostgreSQL) and the
in-process limiter: a request's one usage row, whichever way it ends (durable, or in the
background for a client gone), written once however often it is ended, with the tenant's series
counted and the limiter's reservation handed back with the tokens used."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from sqlalchemy import select

from engine.lora.types import LoRARequest
from gateway.metrics import TenantMetrics
from gateway.tenancy.admission import Ticket
from gateway.tenancy.auth import RequestTenant
from gateway.tenancy.metering import STATUS_ABORTED, STATUS_OK, Meter, UsageFigures
from gateway.tenancy.ratelimit.limits import TenantLimits
from gateway.tenancy.ratelimit.local import LocalLimiter
from tenants.db import Database, upgrade
from tenants.ledger import Ledger
from tenants.models import Usage

TENANT = RequestTenant("ten_a", "acme", 1.0, "salt", key_id="key_a", limits=TenantLimits(
    max_concurrency=2
))  # fmt: skip
ADAPTER = LoRARequest("sql", "/store/ab", "ab" * 32)


def test_one_row_per_request_however_it_ends(database_url: str, tmp_path: Path) -> None:
    upgrade(database_url)

    async def run() -> None:
        db = Database(database_url)
        ledger = Ledger(db, tmp_path / "spool", flush_interval=3600)
        await ledger.start()
        limiter = LocalLimiter()
        registry = CollectorRegistry()
        metrics = TenantMetrics(registry, max_tenants=4)

        async def meter(
            request_id: str, adapter: LoRARequest | None, endpoint: str | None = None
        ) -> Meter:
            reservation, state = await limiter.acquire(TENANT.id, request_id, TENANT.limits, 50)
            return Meter(
                ledger,
                Ticket(limiter, reservation, state),
                metrics,
                TENANT,
                request_id,
                "demo",
                None if adapter is None else "sql",
                adapter,
                time.monotonic(),
                endpoint=endpoint,
            )

        try:
            whole = await meter("cmpl-1", ADAPTER, "chat")
            assert await limiter.in_flight(TENANT.id) == 1
            whole.first_token()
            whole.first_token()  # the first one counts
            await whole.end(UsageFigures(12, 4, 7), "stop", STATUS_OK)
            await whole.end(UsageFigures(99, 0, 99), "length", STATUS_OK)  # ended: nothing

            gone = await meter("cmpl-2", None)
            gone.end_nowait(UsageFigures(5, 0, 1), None, STATUS_ABORTED)
            gone.end_nowait(UsageFigures(5, 0, 9), None, STATUS_ABORTED)
            deadline = time.monotonic() + 30  # the releases run in the background
            while await limiter.in_flight(TENANT.id) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert await limiter.in_flight(TENANT.id) == 0
            assert await ledger.flush(timeout=30)

            async with db.session() as session:
                rows = {r.request_id: r for r in (await session.scalars(select(Usage))).all()}
            assert set(rows) == {"cmpl-1", "cmpl-2"}
            one, two = rows["cmpl-1"], rows["cmpl-2"]
            assert (one.prompt_tokens, one.cached_tokens, one.completion_tokens) == (12, 4, 7)
            assert (one.status, one.finish_reason, one.key_id) == ("ok", "stop", "key_a")
            assert (one.adapter_name, one.adapter_sha256) == ("sql", "ab" * 32)
            assert (one.endpoint, two.endpoint) == ("chat", None)
            assert one.ttft is not None and 0 <= one.ttft <= one.latency
            assert (two.status, two.completion_tokens, two.ttft, two.adapter_name) == (
                "aborted",
                1,
                None,
                None,
            )
            sample = registry.get_sample_value
            labels = {"tenant": "ten_a", "kind": "completion"}
            assert sample("loragate:tenant_tokens_total", labels) == 8
            assert (
                sample("loragate:tenant_requests_total", {"tenant": "ten_a", "status": "ok"}) == 1
            )
        finally:
            await ledger.close()
            await db.close()

    asyncio.run(run())
