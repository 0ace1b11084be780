"""A live uvicorn server on 127.0.0.1 for tests that talk HTTP with the real openai client,
with a tenancy of its own: a database, a tenant and its key, an admin token; and `loragate
serve` itself, as a process (serve_process)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from response_events import SpecWatch

from adapters.peft import BaseModelInfo, describe_base
from bench.servers import wait_ready
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.client import EngineClient
from gateway.settings import Settings
from gateway.tenancy.admin_auth import mint_admin_token
from gateway.tenancy.state import Tenancy, open_tenancy, prepare
from tenants.keys import create_key
from tenants.tenants import create_tenant

TEST_SECRET = "a-test-secret-that-is-long-enough-for-loragate-0123456789"


@dataclass
class ServerTenancy:
    """A server's tenancy, and the credentials a test uses with it."""

    tenancy: Tenancy
    settings: Settings
    tenant_id: str
    api_key: str
    admin_token: str


def make_tenancy(
    root: Path,
    model_dir: Path,
    served_name: str,
    database_url: str | None = None,
    extra_bases: dict[str, BaseModelInfo] | None = None,
    **settings: Any,
) -> ServerTenancy:
    """Migrate a database (a SQLite file under `root` by default), make tenant `tester` with one
    key, and mint an admin token, all as `loragate serve` would. `extra_bases`: base models the
    tenancy knows of besides `served_name` (adapters can be registered on them)."""
    settings.setdefault("usage_spool_dir", root / "loragate-spool")
    config = Settings(
        model=str(model_dir),
        database_url=database_url or f"sqlite+aiosqlite:///{root / 'loragate.db'}",
        secret_key=TEST_SECRET,
        adapter_store=root / "adapters",
        demo_tenant=False,
        **settings,
    )
    bases = {served_name: describe_base(model_dir, extra_names=[served_name])}
    tenancy = open_tenancy(config, bases | (extra_bases or {}))

    async def setup() -> tuple[str, str]:
        await prepare(tenancy, config)
        async with tenancy.db.session() as session, session.begin():
            tenant = await create_tenant(session, name="tester")
            _, key = await create_key(session, tenant_id=tenant.id)
        await tenancy.db.close()  # its connections belong to this loop, not the server's
        return tenant.id, key

    tenant_id, key = asyncio.run(setup())
    return ServerTenancy(tenancy, config, tenant_id, key, mint_admin_token(config, 3600))


class Server:
    def __init__(
        self, base_url: str, engine: EngineClient, app: FastAPI, tenancy: ServerTenancy
    ) -> None:
        self.base_url = base_url
        self.engine = engine
        self.app = app
        self.tenancy = tenancy
        # How what it answered under /v1/responses departs from the spec (response_events).
        self.spec_violations: list[str] = []

    @property
    def headers(self) -> dict[str, str]:
        """A tenant's credentials, for httpx."""
        return {"Authorization": f"Bearer {self.tenancy.api_key}"}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop that serves: coroutines on the app's objects run there."""
        return self.app.state.loop  # type: ignore[no-any-return]

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tenancy.admin_token}"}

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or self.tenancy.api_key,
            max_retries=0,
            timeout=60,
        )

    def wait_all_blocks_free(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._all_free():
                return True
            time.sleep(0.02)
        return False

    def _all_free(self) -> bool:
        if isinstance(self.engine, AsyncEngine):
            kv = self.engine.engine.kv
            return kv.num_free_blocks == kv.pool.num_blocks and not self.engine.engine.parents
        # An engine in another process: its last stats snapshot (sent whenever it idles).
        stats = self.engine.stats()
        return stats.kv_cache_usage == 0 and stats.num_running == stats.num_waiting == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports that are free now, below Linux's ephemeral range
    (32768 and up), where outgoing connections take ports at any moment: for a command that
    puts its own servers on the ports after the one it is given (the remote benches)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_768 - count)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


@contextlib.contextmanager
def live_server(app: FastAPI, engine: EngineClient) -> Iterator[Server]:
    """Serve `app` (built with a ServerTenancy's tenancy) on a free port until the block exits.
    The tenancy starts (the usage ledger's writer) and closes in the loop that serves."""
    tenancy: ServerTenancy = app.state.server_tenancy

    @contextlib.asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        await tenancy.tenancy.start()
        yield
        await tenancy.tenancy.close()

    app.router.lifespan_context = lifespan
    spec_violations: list[str] = []
    app.add_middleware(SpecWatch, violations=spec_violations)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        server = Server(f"http://127.0.0.1:{port}", engine, app, tenancy)
        server.spec_violations = spec_violations
        yield server
    finally:
        uv.should_exit = True
        thread.join(10)
    # Whatever test talked to the Responses API here, what it got follows the spec.
    assert spec_violations == [], spec_violations[:20]


def build_test_app(
    engine: EngineClient,
    served_name: str,
    root: Path,
    model_dir: Path,
    database_url: str | None = None,
    settings: dict[str, Any] | None = None,
    more_models: dict[str, EngineClient] | None = None,
    extra_bases: dict[str, BaseModelInfo] | None = None,
    **build: Any,
) -> FastAPI:
    """build_app with a fresh test tenancy (kept on app.state.server_tenancy). `more_models`:
    base models served beside `served_name`, each with its engine; `extra_bases`: base models
    the adapter catalog knows beside `served_name`'s."""
    from gateway.app import AppOptions, build_app

    tenancy = make_tenancy(
        root, model_dir, served_name, database_url, extra_bases, **(settings or {})
    )
    app = build_app(
        {served_name: engine} | (more_models or {}), tenancy.tenancy, AppOptions(**build)
    )
    app.state.server_tenancy = tenancy
    return app


def lora_engine(
    model_dir: Path,
    kv_cache_memory: int = 64 << 20,
    max_model_len: int = 1024,
    max_waiting: int = 64,
) -> AsyncEngine:
    """A started engine loop on `model_dir` with LoRA (rank up to 16, adapters from the
    registry's loader): float32, one torch thread, a small KV pool."""
    from adapters.registry import RegisteredLoader
    from engine import EngineConfig, LLMEngine

    config = EngineConfig(
        model=str(model_dir),
        kv_cache_memory=kv_cache_memory,
        max_model_len=max_model_len,
        num_threads=1,
        dtype="float32",
    )
    loader = RegisteredLoader(describe_base(model_dir), max_lora_rank=16)
    engine = AsyncEngine(LLMEngine(config, lora_loader=loader), max_waiting=max_waiting)
    engine.start()
    return engine


@contextlib.contextmanager
def demo_server(model_dir: Path, root: Path, **build: Any) -> Iterator[Server]:
    """A live server named `demo` on the demo model: a small KV pool, 1024-token context,
    one torch thread; `build` goes to build_app (e.g. tool_call_parser)."""
    from engine import EngineConfig, LLMEngine

    config = EngineConfig(
        model=str(model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=1024,
        num_threads=1,
        dtype="float32",
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=64)
    engine.start()
    with live_server(build_test_app(engine, "demo", root, model_dir, **build), engine) as server:
        yield server


def register_public(app: FastAPI, name: str, path: Path) -> None:
    """Register a public adapter, as `--lora-modules name=path` does at start."""
    tenancy: ServerTenancy = app.state.server_tenancy
    catalog = tenancy.tenancy.catalog

    async def add() -> None:
        await catalog.put_local(owner_id=None, name=name, path=path)
        await tenancy.tenancy.db.close()

    asyncio.run(add())


def admin_client(server: Server | ServeProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers=server.admin_headers, timeout=60)


def new_tenant(server: Server | ServeProcess, name: str, **fields: object) -> tuple[str, str]:
    """A tenant made through the admin REST, and a key for it: (tenant id, key)."""
    with admin_client(server) as admin:
        created = admin.post("/admin/tenants", json={"name": name} | fields)
        assert created.status_code == 201, created.text
        tenant_id = created.json()["id"]
        key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={})
        assert key.status_code == 201, key.text
    return tenant_id, key.json()["key"]


def usage_rows(database_url: str, **where: object) -> list[dict[str, Any]]:
    """The usage ledger's rows in the database (a synchronous read, as billing would do it)."""
    import sqlalchemy as sa

    from tenants.db import async_url

    url = sa.engine.make_url(async_url(database_url))
    sync = {"sqlite+aiosqlite": "sqlite", "postgresql+asyncpg": "postgresql+psycopg"}
    engine = sa.create_engine(url.set(drivername=sync[url.drivername]))
    try:
        with engine.connect() as conn:
            table = sa.Table("usage", sa.MetaData(), autoload_with=conn)
            query = sa.select(table).where(*(table.c[k] == v for k, v in where.items()))
            return [dict(row._mapping) for row in conn.execute(query)]
    finally:
        engine.dispose()


def wait_for_usage(
    database_url: str, count: int, timeout: float = 30.0, **where: object
) -> list[dict[str, Any]]:
    """The rows once there are `count` of them (the ledger writes in batches off the request
    path); fails if more, or if they do not arrive."""
    deadline = time.monotonic() + timeout
    while True:
        rows = usage_rows(database_url, **where)
        if len(rows) >= count or time.monotonic() > deadline:
            assert len(rows) == count, f"{len(rows)} usage rows, expected {count}"
            return rows
        time.sleep(0.1)


@dataclass(frozen=True)
class ServeProcess:
    """A `loragate serve` process: its URL, its process group, and admin credentials that it
    accepts (a token signed with TEST_SECRET)."""

    url: str
    pid: int

    @property
    def base_url(self) -> str:
        return self.url

    @property
    def admin_headers(self) -> dict[str, str]:
        token = mint_admin_token(Settings(secret_key=TEST_SECRET), 3600)
        return {"Authorization": f"Bearer {token}"}


@contextlib.contextmanager
def serve_process(model_dir: Path, cwd: Path, *flags: str) -> Iterator[ServeProcess]:
    """`loragate serve` of `model_dir` as `demo` in `cwd` (its SQLite database and adapter
    store), in a process group of its own, until the block exits: a 64 MiB KV pool, 256-token
    context, no demo tenant; `flags` after those (a later flag wins)."""
    port = free_port()
    cwd.mkdir(parents=True, exist_ok=True)
    command = [
        str(Path(sys.executable).parent / "loragate"),
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        "demo",
        "--port",
        str(port),
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "256",
        "--no-demo-tenant",
        *flags,
    ]
    log = (cwd / "serve.log").open("ab")
    server = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cwd,
        env=os.environ | {"LORAGATE_SECRET_KEY": TEST_SECRET, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, cwd / "serve.log", "/health", timeout=180)
        yield ServeProcess(url, server.pid)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
