"""Alembic owns the schema: the migrations build exactly the models' tables, on SQLite and on
PostgreSQL, and take them down again."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect
from sqlalchemy.engine import make_url

from tenants.db import async_url, current_revision, downgrade, upgrade
from tenants.models import Base

TABLES = {"tenants", "api_keys", "adapters", "usage"}


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
