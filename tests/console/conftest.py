"""The console's tests: a live `loragate serve` on the demo model, and Debian's Chromium driven
by Playwright (headless; the system browser, since none can be downloaded here)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # live_server lives there
from live_server import TEST_SECRET, free_port  # noqa: E402

MODEL = "demo"
CHROMIUM = "/usr/bin/chromium"
# As the machine's own probe starts it: no sandbox as root, and no background connections
# (the machine reaches no network; Chromium's attempts would be refused, many at a time).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
# Screenshots of every page: here, or where LORAGATE_TEST_ARTIFACTS points.
ARTIFACTS = Path(os.environ.get("LORAGATE_TEST_ARTIFACTS", "build/test-artifacts")) / "console"


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium: installed from Debian's packages when missing, if this may."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and cannot be here (apt-get install chromium)")
    done = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
        capture_output=True,
        text=True,
        env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"},
    )
    if done.returncode != 0 or not os.path.exists(CHROMIUM):
        pytest.skip(f"apt-get install chromium failed: {done.stderr.strip()[-300:]}")
    return CHROMIUM


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


@pytest.fixture(scope="module")
def console_server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleServer]:
    """`loragate serve` on the demo model as a user starts it, with a fresh SQLite database."""
    with serve(demo_model_dir, tmp_path_factory.mktemp("console-serve")) as server:
        server.admin_token = server.loragate("admin", "token", "--ttl", "2h", "--subject", "ops")
        yield server


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
        _wait_ready(url, server, log_path)
        key = re.search(r"export LORAGATE_API_KEY=(lg-\S+)", log_path.read_text())
        assert key is not None, log_path.read_text()
        yield ConsoleServer(url, "", key.group(1), log_path, cwd)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_ready(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"loragate serve exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).json().get("status") == "ok":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"loragate serve never became healthy: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    # A refused request (a 400 the page shows at its field) is logged by Chromium as an error
    # too: those are the tests' to judge, not script errors.
    opened.on(
        "console",
        lambda msg: (
            errors.append(msg.text)
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    opened.script_errors = errors
    opened.refused = []
    opened.on(
        "response",
        lambda r: opened.refused.append(f"{r.status} {r.url}") if r.status >= 400 else None,
    )
    try:
        yield opened
    finally:
        context.close()


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
