"""The console's tests: a live `loragate serve` on the demo model, and Debian's Chromium driven
by Playwright (headless; the system browser, since none can be downloaded here)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from console_server import VIEWPORT, ConsoleServer, serve

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


@pytest.fixture(scope="module")
def console_server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleServer]:
    """`loragate serve` on the demo model as a user starts it, with a fresh SQLite database."""
    with serve(demo_model_dir, tmp_path_factory.mktemp("console-serve")) as server:
        server.admin_token = server.loragate("admin", "token", "--ttl", "2h", "--subject", "ops")
        yield server


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
