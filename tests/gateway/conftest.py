"""Fixtures for the tenancy tests: one engine per module, a server per test and database."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import Server, build_test_app, live_server, lora_engine

from engine.frontend.async_engine import AsyncEngine

MODEL = "demo"
MAX_ADAPTER_BYTES = 4 << 20


@pytest.fixture(scope="module")
def tenancy_engine(demo_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = lora_engine(demo_model_dir)
    yield engine
    asyncio.run(engine.shutdown(0))


@pytest.fixture
def tenancy_server(
    tenancy_engine: AsyncEngine, demo_model_dir: Path, database_url: str, tmp_path: Path
) -> Iterator[Server]:
    """A server on a fresh database of each kind (SQLite, PostgreSQL)."""
    app = build_test_app(
        tenancy_engine,
        MODEL,
        tmp_path,
        demo_model_dir,
        database_url,
        settings={"max_adapter_bytes": MAX_ADAPTER_BYTES},
    )
    with live_server(app, tenancy_engine) as server:
        yield server
