"""Everything multi-tenant the gateway holds: the database, tenant and admin authentication,
the adapter catalog, the stored responses (/v1/responses) and conversations
(/v1/conversations), the files (/v1/files) and batches (/v1/batches), and how they start.

`open_tenancy` migrates the database (unless told not to), sweeps the adapter store, and on
an empty database creates the `demo` tenant with one key, which it returns once so the
command line can print it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from adapters.peft import BaseModelInfo
from adapters.store import open_adapter_store, store_directory
from gateway.settings import Settings
from gateway.tenancy.adapter_catalog import AdapterCatalog
from gateway.tenancy.admin_auth import AdminAuth
from gateway.tenancy.auth import RequestTenant, TenantAuth, request_tenant
from gateway.tenancy.ratelimit import LimiterOptions, RateLimiter, make_limiter
from tenants.batch_lines import LineClaims
from tenants.batches import BatchStore
from tenants.conversations import ConversationStore
from tenants.db import Database, upgrade
from tenants.files import FileStore
from tenants.keys import create_key
from tenants.ledger import Ledger
from tenants.responses import BEAT_INTERVAL, SILENT_AFTER, ResponseStore
from tenants.tenants import count_tenants, create_tenant, get_tenant_by_name
from tenants.usage import tokens_used

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"


class Service(Protocol):
    """Background work of the app's that runs while the tenancy does (the batch runner):
    started after the usage ledger, stopped before it."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Tenancy:
    db: Database
    auth: TenantAuth
    admin: AdminAuth
    catalog: AdapterCatalog
    ledger: Ledger
    limiter: RateLimiter
    secret_key: bytes
    # --no-auth: every /v1 request runs as this tenant.
    no_auth_tenant: RequestTenant | None = None
    metrics_auth: bool = False
    allow_local_adapter_paths: bool = False
    max_adapter_bytes: int = 1 << 30
    # Limits of a tenant created without them (admin REST): field name -> value or None.
    default_limits: dict[str, int | None] = field(default_factory=dict)
    # The Responses API's stored responses; None: no such routes.
    responses: ResponseStore | None = None
    # The Conversations API's conversations (kept and capped as responses are); None: no such
    # routes (and no `conversation` on a response).
    conversations: ConversationStore | None = None
    # The Files API's files (a batch's input uploaded, its output written); None: no such
    # routes. An upload's bounds: its bytes and its lines.
    files: FileStore | None = None
    batch_file_max_bytes: int = 200 << 20
    batch_file_max_lines: int = 50_000
    # The Batch API's batches, and the claims on their lines; None: no such routes.
    batches: BatchStore | None = None
    batch_lines: LineClaims | None = None
    responses_sweep_interval: float = 600.0
    services: list[Service] = field(default_factory=list)
    _sweeper: asyncio.Task[None] | None = None

    @property
    def model_names(self) -> list[str]:
        """The base models this server serves, by the names clients send."""
        return self.catalog.model_names

    async def start(self) -> None:
        """Start the background work (the usage ledger's writer, the sweep of stored responses
        and conversations) in the event loop that serves: the database's connections belong
        to it."""
        await self.ledger.start()
        if self.responses is not None:
            self._sweeper = asyncio.create_task(self._sweep_responses(self.responses))
        for service in self.services:
            await service.start()

    async def _sweep_responses(self, store: ResponseStore) -> None:
        """Background responses whose gateway fell silent fail (every BEAT_INTERVAL); expired
        responses and conversations go (every responses_sweep_interval)."""
        swept_at = 0.0
        while True:
            try:
                failed = await store.fail_unfinished(silent_for=SILENT_AFTER)
                if failed:
                    logger.warning("%d background responses a stopped gateway left: failed", failed)
                if time.monotonic() - swept_at >= self.responses_sweep_interval:
                    swept_at = time.monotonic()
                    removed = await store.sweep()
                    if removed:
                        logger.info("removed %d expired stored responses", removed)
                    if self.conversations is not None:
                        removed = await self.conversations.sweep()
                        if removed:
                            logger.info("removed %d expired conversations", removed)
            except Exception:  # noqa: BLE001 - a database hiccup: the next round tries again
                logger.exception("sweeping stored responses failed")
            await asyncio.sleep(BEAT_INTERVAL)

    async def close(self) -> None:
        for service in self.services:
            await service.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.auth.drain()
        await self.ledger.close()  # its last rows reach the database before it closes
        await self.limiter.close()
        await self.db.close()


@dataclass(frozen=True, slots=True)
class DemoKey:
    tenant: str
    key: str


def open_tenancy(settings: Settings, bases: dict[str, BaseModelInfo]) -> Tenancy:
    """The tenancy objects for a server with these settings that serves `bases` (each served
    model's name, the `model` clients send, to what its adapters are checked against; the
    first is the default). Synchronous: run it before the event loop starts, or in a thread.
    Raises SettingsError for unusable secrets."""
    settings.check_no_auth()
    settings.check_tool_choice()
    secret_key = settings.resolved_secret_key()
    if settings.db_upgrade:
        upgrade(settings.database_url)
    db = Database(settings.database_url)
    catalog = AdapterCatalog(
        db,
        open_adapter_store(settings.adapter_store),
        bases,
        settings.max_lora_rank,
        ttl=settings.tenant_cache_ttl,
    )
    return Tenancy(
        db=db,
        auth=TenantAuth(db, secret_key, settings.tenant_cache_ttl),
        admin=AdminAuth(settings),
        catalog=catalog,
        ledger=Ledger(
            db, settings.resolved_usage_spool_dir, flush_interval=settings.usage_flush_interval
        ),
        limiter=make_limiter(
            settings.redis_url,
            LimiterOptions(
                failure_mode=settings.redis_failure_mode,
                key_prefix=settings.redis_key_prefix,
                concurrency_lease=settings.concurrency_lease,
                timeout=settings.redis_timeout,
            ),
            quota_used=_monthly_usage(db),
        ),
        secret_key=secret_key,
        metrics_auth=settings.metrics_auth,
        allow_local_adapter_paths=settings.allow_local_adapter_paths,
        max_adapter_bytes=settings.max_adapter_bytes,
        default_limits={
            "rpm_limit": settings.default_rpm_limit,
            "tpm_limit": settings.default_tpm_limit,
            "max_concurrency": settings.default_max_concurrency,
            "monthly_token_quota": settings.default_monthly_token_quota,
        },
        responses=ResponseStore(
            db,
            ttl=settings.responses_ttl,
            max_per_tenant=settings.responses_max_stored_per_tenant,
        ),
        conversations=ConversationStore(
            db,
            ttl=settings.responses_ttl,
            max_per_tenant=settings.responses_max_stored_per_tenant,
        ),
        responses_sweep_interval=settings.responses_sweep_interval,
        files=FileStore(
            db,
            Path(store_directory(str(settings.adapter_store))) / "files",
            max_per_tenant=settings.files_max_per_tenant,
        ),
        batch_file_max_bytes=settings.batch_file_max_bytes,
        batch_file_max_lines=settings.batch_file_max_lines,
        batches=BatchStore(db),
        batch_lines=LineClaims(db),
    )


def _monthly_usage(db: Database) -> Callable[[str, datetime], Awaitable[int]]:
    """What the ledger says a tenant used since the month began: where a quota counter starts
    (so a restart, or a Redis that lost its keys, does not reset a quota)."""

    async def used(tenant_id: str, since: datetime) -> int:
        async with db.session() as session:
            return await tokens_used(session, tenant_id=tenant_id, since=since)

    return used


async def prepare(tenancy: Tenancy, settings: Settings) -> DemoKey | None:
    """Start-up work on the database: sweep the adapter store, make the demo tenant on an empty
    database (its key returned, to be shown once), and find the --no-auth tenant."""
    removed = await tenancy.catalog.sweep()
    if removed:
        logger.info("removed %d stored adapters no row references", len(removed))
    if tenancy.files is not None and (swept := await tenancy.files.sweep()):
        logger.info("removed %d stored files no row names", swept)
    if unserved := await tenancy.catalog.unserved():
        logger.warning(
            "adapters of base models this server does not serve name nothing: %s",
            ", ".join(f"{count} on {model!r}" for model, count in unserved.items()),
        )
    demo = None
    async with tenancy.db.session() as session, session.begin():
        if settings.demo_tenant and await count_tenants(session) == 0:
            tenant = await create_tenant(session, name=DEMO_TENANT)
            _, key = await create_key(session, tenant_id=tenant.id, name="demo")
            demo = DemoKey(DEMO_TENANT, key)
        if not settings.auth:
            found = await get_tenant_by_name(session, name=DEMO_TENANT)
            tenant = found or await create_tenant(session, name=DEMO_TENANT)
            tenancy.no_auth_tenant = request_tenant(tenancy.secret_key, tenant)
    return demo
