"""Usage rows as the ledger writes them, for tests of the ledger's read side: one record with
plain defaults (100 prompt tokens, 10 cached, 5 completion, status ok) and the fields a test
names, and a synchronous insert of such rows into a server's database."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tenants.db import async_url
from tenants.ledger import UsageRecord
from tenants.models import Usage

DEFAULTS: dict[str, Any] = {
    "key_id": "key_a",
    "model": "demo",
    "adapter_name": None,
    "adapter_sha256": None,
    "prompt_tokens": 100,
    "cached_tokens": 10,
    "completion_tokens": 5,
    "finish_reason": "stop",
    "status": "ok",
    "ttft": 0.01,
    "latency": 0.1,
}


def usage_record(
    request_id: str, tenant_id: str, created_at: datetime, **fields: Any
) -> UsageRecord:
    values = DEFAULTS | {"request_id": request_id, "tenant_id": tenant_id, "created_at": created_at}
    return UsageRecord(**(values | fields))


def insert_usage(database_url: str, records: list[UsageRecord]) -> None:
    """Rows straight into the database a server uses (its URL as the server was given it)."""
    url = sa.engine.make_url(async_url(database_url))
    sync = {"sqlite+aiosqlite": "sqlite", "postgresql+asyncpg": "postgresql+psycopg"}
    engine = sa.create_engine(url.set(drivername=sync[url.drivername]))
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(Usage.__table__), [r.row() for r in records])
    finally:
        engine.dispose()
