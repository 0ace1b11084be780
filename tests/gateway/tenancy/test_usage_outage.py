"""The usage ledger through a database outage, through HTTP: with INSERT on `usage` revoked
from the server's PostgreSQL role, 200 mixed requests (whole, streamed, hung up mid-stream,
abandoned while waiting) are answered as usual; their rows wait in the spool and, once the
grant is back, arrive exactly once each."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest
from held_engine import HELD_MAX_TOKENS, HoldingEngine
from live_server import Server, build_test_app, live_server, usage_rows, wait_for_usage

from engine.frontend.async_engine import AsyncEngine
from tenants.db import upgrade

MODEL = "demo"
NUM_REQUESTS = 200


def _psql(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture
def database_url(postgres_url: str) -> str:
    return postgres_url  # roles and grants are PostgreSQL's


@pytest.fixture
def role_url(database_url: str) -> Iterator[str]:
    """The database migrated, and a role that may do what a gateway does in it (its URL)."""
    upgrade(database_url)
    role = f"gateway_{secrets.token_hex(4)}"
    _psql(
        database_url,
        f"CREATE ROLE {role} LOGIN",
        f"GRANT USAGE ON SCHEMA public TO {role}",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}",
    )
    try:
        yield database_url.replace("postgresql://postgres@", f"postgresql://{role}@")
    finally:
        _psql(database_url, f"DROP OWNED BY {role}", f"DROP ROLE {role}")


@pytest.fixture
def server(
    tenancy_engine: AsyncEngine, demo_model_dir: Path, role_url: str, tmp_path: Path
) -> Iterator[Server]:
    app = build_test_app(
        HoldingEngine(tenancy_engine),  # type: ignore[arg-type]
        MODEL,
        tmp_path,
        demo_model_dir,
        role_url,
        settings={"db_upgrade": False, "usage_flush_interval": 0.1},
    )
    with live_server(app, tenancy_engine) as server:
        yield server


def _request(server: Server, i: int) -> str | None:
    """Request `i` of the mix; its id where the client saw one."""
    url = f"{server.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 6, "temperature": 0}
    kind = i % 4
    if kind == 0:  # whole
        resp = httpx.post(url, headers=server.headers, json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["id"])
    if kind == 3:  # abandoned while waiting for a whole answer (a second: it has started)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                url,
                headers=server.headers,
                json=body | {"max_tokens": HELD_MAX_TOKENS, "ignore_eos": True},
                timeout=1.0,
            )
        return None
    long = {"max_tokens": 300, "ignore_eos": True} if kind == 2 else {}
    with httpx.stream(
        "POST", url, headers=server.headers, json=body | long | {"stream": True}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                request_id = str(json.loads(line[6:])["id"])
                if kind == 2:
                    return request_id  # hung up mid-stream
    return request_id


def test_rows_wait_out_a_database_outage_and_arrive_once(
    server: Server, database_url: str, role_url: str
) -> None:
    role = role_url.split("//")[1].split("@")[0]
    _psql(database_url, f"REVOKE INSERT ON usage FROM {role}")
    with ThreadPoolExecutor(8) as pool:
        seen = [r for r in pool.map(lambda i: _request(server, i), range(NUM_REQUESTS)) if r]
    pending = f"loragate:usage_rows_pending {float(NUM_REQUESTS)}"
    deadline = time.monotonic() + 30  # the abandoned requests' rows follow their hang-ups
    while pending not in httpx.get(f"{server.base_url}/metrics").text:
        assert time.monotonic() < deadline, "not every row reached the spool"
        time.sleep(0.1)
    assert usage_rows(database_url) == []
    _psql(database_url, f"GRANT INSERT ON usage TO {role}")
    rows = wait_for_usage(database_url, NUM_REQUESTS)
    ids = [r["request_id"] for r in rows]
    assert len(set(ids)) == NUM_REQUESTS and set(seen) <= set(ids)
    statuses = {s: sum(r["status"] == s for r in rows) for s in ("ok", "aborted", "error")}
    # Whole and short streams finish; the others were stopped by their clients.
    assert statuses == {"ok": NUM_REQUESTS // 2, "aborted": NUM_REQUESTS // 2, "error": 0}
    assert server.wait_all_blocks_free()
