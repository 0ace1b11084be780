"""A live uvicorn server on 127.0.0.1 for tests that talk HTTP with the real openai client."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import openai
import uvicorn
from fastapi import FastAPI

from engine.async_engine import AsyncEngine, EngineClient


class Server:
    def __init__(self, base_url: str, engine: EngineClient, app: FastAPI | None = None) -> None:
        self.base_url = base_url
        self.engine = engine
        self.app = app

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60
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


@contextlib.contextmanager
def live_server(app: FastAPI, engine: EngineClient) -> Iterator[Server]:
    """Serve `app` on a free port until the block exits."""
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    try:
        yield Server(f"http://127.0.0.1:{port}", engine, app)
    finally:
        uv.should_exit = True
        thread.join(10)
