"""Migration 0005 (the console's usage queries), on PostgreSQL where it acts: the tenant's
usage index carries the token sums, the day bucket has statistics of its own, and a
downgrade puts the plain index back. On SQLite it changes nothing. (compare_metadata in
test_migrations.py sees neither INCLUDE columns nor statistics.)"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, inspect, text

from tenants.db import current_revision, downgrade, upgrade

INDEX = "ix_usage_tenant_id_created_epoch"


def _index_definition(url: str) -> str:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            query = text("SELECT indexdef FROM pg_indexes WHERE indexname = :name")
            return str(conn.execute(query, {"name": INDEX}).scalar_one())
    finally:
        engine.dispose()


def _statistics(url: str) -> list[str]:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            query = "SELECT stxname FROM pg_statistic_ext WHERE stxrelid = 'usage'::regclass"
            return [name for (name,) in conn.execute(text(query))]
    finally:
        engine.dispose()


def test_0005_covers_the_tenant_index_and_gives_days_statistics(postgres_url: str) -> None:
    upgrade(postgres_url, "0004")
    assert "INCLUDE" not in _index_definition(postgres_url)
    assert _statistics(postgres_url) == []
    upgrade(postgres_url, "0005")
    assert current_revision(postgres_url) == "0005"
    definition = _index_definition(postgres_url)
    assert definition.endswith(
        "(tenant_id, created_epoch) INCLUDE (prompt_tokens, cached_tokens, completion_tokens)"
    )
    assert _statistics(postgres_url) == ["usage_created_day"]
    downgrade(postgres_url, "0004")
    assert "INCLUDE" not in _index_definition(postgres_url)
    assert _statistics(postgres_url) == []


def test_0005_leaves_sqlite_as_it_was(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'loragate.db'}"
    upgrade(url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            indexes = {i["name"]: i["column_names"] for i in inspect(conn).get_indexes("usage")}
    finally:
        engine.dispose()
    assert indexes[INDEX] == ["tenant_id", "created_epoch"]
    downgrade(url, "0004")
    assert current_revision(url) == "0004"
