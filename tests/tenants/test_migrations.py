"""Alembic owns the schema: the migrations build exactly the models' tables, on SQLite and on
PostgreSQL, and take them down again."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, Table, create_engine, delete, insert, inspect, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from tenants.db import async_url, current_revision, downgrade, upgrade
from tenants.models import Base

TABLES = {
    "tenants",
    "api_keys",
    "adapters",
    "usage",
    "responses",
    "conversations",
    "conversation_items",
    "files",
    "batches",
    "batch_lines",
}


def _sync_engine(url: str):  # type: ignore[no-untyped-def]
    parsed = make_url(async_url(url))
    drivers = {"sqlite+aiosqlite": "sqlite", "postgresql+asyncpg": "postgresql+psycopg"}
    return create_engine(parsed.set(drivername=drivers[parsed.drivername]))


def test_the_migrations_build_the_models_and_come_down_again(database_url: str) -> None:
    upgrade(database_url)
    assert current_revision(database_url) is not None
    engine = _sync_engine(database_url)
    try:
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) >= TABLES
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            assert compare_metadata(context, Base.metadata) == []
        downgrade(database_url, "base")
        assert current_revision(database_url) is None
        with engine.connect() as conn:
            assert not TABLES & set(inspect(conn).get_table_names())
        upgrade(database_url)  # and up again from empty
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) >= TABLES
    finally:
        engine.dispose()


def _adapter_row(scope: str, name: str, base_model: str) -> dict[str, object]:
    return {
        "id": f"ad_{scope}_{name}_{base_model}",
        "owner_id": None,
        "scope": scope,
        "name": name,
        "base_model": base_model,
        "rank": 8,
        "alpha": 16.0,
        "target_modules": ["q_proj"],
        "sha256": "0" * 64,
        "size_bytes": 1,
        "storage_path": "0" * 64,
        "status": "ready",
        "created_at": datetime(2026, 12, 1, tzinfo=UTC),
    }


def test_0003_names_adapters_per_base_model_and_adds_allowed_models(database_url: str) -> None:
    """Rows written before 0003 survive it both ways; after it one owner may hold a name on two
    base models, and a tenant has `allowed_models` (null for the tenants that were there)."""
    upgrade(database_url, "0002")
    engine = _sync_engine(database_url)
    try:
        metadata = MetaData()
        with engine.begin() as conn:
            tenants = Table("tenants", metadata, autoload_with=conn)
            conn.execute(
                insert(tenants).values(
                    id="ten_old",
                    name="old",
                    status="active",
                    created_at=datetime(2026, 12, 1, tzinfo=UTC),
                    weight=1.0,
                )
            )
            conn.execute(
                insert(Table("adapters", metadata, autoload_with=conn)),
                [_adapter_row("public", "sql", "demo")],
            )
        with pytest.raises(IntegrityError), engine.begin() as conn:  # one name per owner, yet
            conn.execute(
                insert(Table("adapters", MetaData(), autoload_with=conn)),
                [_adapter_row("public", "sql", "smollm2")],
            )

        upgrade(database_url, "0003")
        with engine.begin() as conn:
            adapters = Table("adapters", MetaData(), autoload_with=conn)
            conn.execute(insert(adapters), [_adapter_row("public", "sql", "smollm2")])
            with pytest.raises(IntegrityError), conn.begin_nested():
                conn.execute(
                    insert(adapters), [_adapter_row("public", "sql", "demo") | {"id": "x"}]
                )
            tenants = Table("tenants", MetaData(), autoload_with=conn)
            assert conn.execute(select(tenants.c.allowed_models)).scalar_one() is None
            conn.execute(update(tenants).values(allowed_models=["demo"]))
            assert conn.execute(select(tenants.c.allowed_models)).scalar_one() == ["demo"]

        # Down again: refused while a name is on two base models, done once it is not.
        with pytest.raises(RuntimeError, match="public/sql"):
            downgrade(database_url, "0002")
        assert current_revision(database_url) == "0003"
        with engine.begin() as conn:
            adapters = Table("adapters", MetaData(), autoload_with=conn)
            conn.execute(delete(adapters).where(adapters.c.base_model == "smollm2"))
        downgrade(database_url, "0002")
        with engine.connect() as conn:
            assert "allowed_models" not in {c["name"] for c in inspect(conn).get_columns("tenants")}
            unique = inspect(conn).get_unique_constraints("adapters")
            assert [(u["name"], u["column_names"]) for u in unique] == [
                ("uq_adapters_scope_name", ["scope", "name"])
            ]
            adapters = Table("adapters", MetaData(), autoload_with=conn)
            assert conn.execute(select(adapters.c.name, adapters.c.base_model)).all() == [
                ("sql", "demo")
            ]
    finally:
        engine.dispose()


def _usage_row(request_id: str) -> dict[str, object]:
    created = datetime(2026, 12, 1, tzinfo=UTC)
    return {
        "request_id": request_id,
        "tenant_id": "ten_old",
        "key_id": None,
        "model": "demo",
        "adapter_name": None,
        "adapter_sha256": None,
        "prompt_tokens": 3,
        "cached_tokens": 0,
        "completion_tokens": 1,
        "finish_reason": "stop",
        "status": "ok",
        "ttft": None,
        "latency": 0.1,
        "created_at": created,
        "created_epoch": int(created.timestamp()),
    }


def test_0004_adds_stored_responses_and_usage_endpoints(database_url: str) -> None:
    """Usage rows written before 0004 survive it both ways (their endpoint null); after it a
    tenant's responses are stored, and deleted with the tenant on PostgreSQL (SQLite enforces
    no foreign keys unless asked); down again, the table and the column go."""
    upgrade(database_url, "0003")
    engine = _sync_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(insert(Table("usage", MetaData(), autoload_with=conn)), [_usage_row("a")])

        upgrade(database_url, "0004")
        created = datetime(2026, 12, 15, tzinfo=UTC)
        with engine.begin() as conn:
            usage = Table("usage", MetaData(), autoload_with=conn)
            conn.execute(insert(usage), [_usage_row("b") | {"endpoint": "responses"}])
            found = conn.execute(
                select(usage.c.request_id, usage.c.endpoint).order_by("request_id")
            )
            assert found.all() == [("a", None), ("b", "responses")]
            conn.execute(
                insert(Table("tenants", MetaData(), autoload_with=conn)).values(
                    id="ten_new", name="new", status="active", created_at=created, weight=1.0
                )
            )
            responses = Table("responses", MetaData(), autoload_with=conn)
            conn.execute(
                insert(responses).values(
                    id="resp_" + "0" * 32,
                    tenant_id="ten_new",
                    key_id=None,
                    model="demo",
                    status="completed",
                    background=False,
                    previous_response_id="resp_gone",  # no foreign key: may have expired
                    input_items=[{"type": "message", "content": "hi"}],
                    output=[],
                    body={"status": "completed"},
                    created_at=created,
                    expires_at=created,
                    heartbeat_at=created,
                )
            )
            assert conn.execute(select(responses.c.input_items)).scalar_one() == [
                {"type": "message", "content": "hi"}
            ]
            if conn.dialect.name == "postgresql":
                tenants = Table("tenants", MetaData(), autoload_with=conn)
                conn.execute(delete(tenants).where(tenants.c.id == "ten_new"))
                assert conn.execute(select(responses.c.id)).all() == []

        downgrade(database_url, "0003")
        with engine.connect() as conn:
            assert "responses" not in inspect(conn).get_table_names()
            assert "endpoint" not in {c["name"] for c in inspect(conn).get_columns("usage")}
            usage = Table("usage", MetaData(), autoload_with=conn)
            assert conn.execute(select(usage.c.request_id).order_by("request_id")).all() == [
                ("a",),
                ("b",),
            ]
    finally:
        engine.dispose()


def test_0006_adds_conversations_whose_items_go_with_them(database_url: str) -> None:
    """After 0006 a tenant's conversations and their items are stored, an item id once per
    conversation; on PostgreSQL a conversation's items go with it and its conversations with
    the tenant (SQLite enforces no foreign keys unless asked: the code deletes by hand); down
    again, both tables go."""
    upgrade(database_url, "0006")
    created = datetime(2027, 1, 10, tzinfo=UTC)
    engine = _sync_engine(database_url)
    try:
        with engine.begin() as conn:
            tenants = Table("tenants", MetaData(), autoload_with=conn)
            conn.execute(
                insert(tenants).values(
                    id="ten_new", name="new", status="active", created_at=created, weight=1.0
                )
            )
            conversations = Table("conversations", MetaData(), autoload_with=conn)
            items = Table("conversation_items", MetaData(), autoload_with=conn)
            for n in (1, 2):
                conn.execute(
                    insert(conversations).values(
                        id=f"conv_{n}",
                        tenant_id="ten_new",
                        key_id=None,
                        metadata={"n": str(n)},
                        next_position=1,
                        created_at=created,
                        expires_at=created,
                    )
                )
                conn.execute(
                    insert(items).values(
                        conversation_id=f"conv_{n}",
                        position=0,
                        item_id="msg_1",  # the same id in two conversations
                        item={"type": "message", "content": "hi"},
                        created_at=created,
                    )
                )
            assert conn.execute(select(conversations.c.metadata).order_by("id")).all() == [
                ({"n": "1"},),
                ({"n": "2"},),
            ]
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(
                insert(items).values(
                    conversation_id="conv_1",
                    position=1,
                    item_id="msg_1",
                    item={},
                    created_at=created,
                )
            )
        if engine.dialect.name == "postgresql":
            with engine.begin() as conn:
                conn.execute(delete(conversations).where(conversations.c.id == "conv_1"))
                assert conn.execute(select(items.c.conversation_id)).all() == [("conv_2",)]
                conn.execute(delete(tenants).where(tenants.c.id == "ten_new"))
                assert conn.execute(select(conversations.c.id)).all() == []
                assert conn.execute(select(items.c.item_id)).all() == []

        downgrade(database_url, "0005")
        with engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
            assert not {"conversations", "conversation_items"} & names
            assert "responses" in names
    finally:
        engine.dispose()
