"""A live `loragate serve` on the demo model for the console's tests, and what the tests do
with a page (screenshots, signing in)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # live_server lives there
from live_server import TEST_SECRET, free_port  # noqa: E402

from bench.servers import wait_ready  # noqa: E402

MODEL = "demo"
VIEWPORT = {"width": 1280, "height": 800}
# Screenshots of every page: here, or where LORAGATE_TEST_ARTIFACTS points.
ARTIFACTS = Path(os.environ.get("LORAGATE_TEST_ARTIFACTS", "build/test-artifacts")) / "console"


@dataclass
class ConsoleServer:
    url: str
    admin_token: str
    demo_key: str
    log: Path
    cwd: Path

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def loragate(self, *args: str) -> str:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "loragate"), *args],
            cwd=self.cwd,
            capture_output=True,
            text=True,
            check=True,
            env=os.environ | {"LORAGATE_SECRET_KEY": TEST_SECRET},
        )
        return done.stdout.strip()


@contextlib.contextmanager
def serve(model_dir: Path, cwd: Path, *flags: str) -> Iterator[ConsoleServer]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = cwd / "serve.log"
    command = [
        str(Path(sys.executable).parent / "loragate"),
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "256",
        "--usage-flush-interval",
        "0.1",
        *flags,
    ]
    env = os.environ | {
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "400",
        "LORAGATE_SECRET_KEY": TEST_SECRET,
    }
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd
        )
    try:
        wait_ready(url, server, log_path, "/health", timeout=180)
        key = re.search(r"export LORAGATE_API_KEY=(lg-\S+)", log_path.read_text())
        assert key is not None, log_path.read_text()
        yield ConsoleServer(url, "", key.group(1), log_path, cwd)
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its engine process
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


def sign_in(page: Any, server: ConsoleServer) -> None:
    page.goto(f"{server.url}/console")
    page.get_by_label("Admin token").fill(server.admin_token)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Tenants", exact=True).wait_for()
