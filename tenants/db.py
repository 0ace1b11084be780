"""The database: an async engine and sessions from a URL, and the migrations that own its
schema (alembic, one revision chain in migrations/).

SQLite (aiosqlite) is the embedded default; PostgreSQL (asyncpg) takes `postgresql://` or
`postgresql+asyncpg://` URLs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"


def async_url(url: str) -> str:
    """The URL with an async driver: postgresql:// means asyncpg, sqlite:// aiosqlite."""
    parsed = make_url(url)
    driver = {"postgresql": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite"}
    if parsed.drivername in driver:
        parsed = parsed.set(drivername=driver[parsed.drivername])
    return parsed.render_as_string(hide_password=False)


class Database:
    def __init__(self, url: str) -> None:
        self.url = async_url(url)
        parsed = make_url(self.url)
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            kwargs = {"connect_args": {"timeout": 30}}
        self.engine: AsyncEngine = create_async_engine(self.url, **kwargs)
        # `db.session()` makes a session: the sessionmaker itself, not a method around it.
        self.session: async_sessionmaker[AsyncSession] = async_sessionmaker(
            self.engine, expire_on_commit=False
        )

    async def close(self) -> None:
        await self.engine.dispose()


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # alembic's config is an ini file: a literal % must be doubled.
    config.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database to `revision` (creating it if it is an empty SQLite file). Call
    from synchronous code: the migrations run their own event loop."""
    parsed = make_url(async_url(url))
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    sync = make_url(async_url(url))
    drivers = {"sqlite+aiosqlite": "sqlite", "postgresql+asyncpg": "postgresql+psycopg"}
    engine = create_engine(sync.set(drivername=drivers.get(sync.drivername, sync.drivername)))
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
