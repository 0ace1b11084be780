"""Every console page: axe-core (vendored) finds no serious or critical violation, every control
is reachable with the keyboard, and a page makes few requests on load."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from console_server import MODEL, VIEWPORT, ConsoleServer, screenshot, sign_in

AXE = Path(__file__).parent / "vendor" / "axe-core" / "axe.min.js"
PAGES = ["tenants", "tenant", "usage", "batches", "tenant-batches", "adapters", "engines"]
# What the Tab key must reach: every visible control.
CONTROLS = "a[href], button:not([disabled]), input:not([disabled]), select, textarea"


@pytest.fixture(scope="module")
def tenant_id(console_server: ConsoleServer) -> str:
    made = httpx.post(
        f"{console_server.url}/admin/tenants", json={"name": "a11y"}, headers=console_server.admin()
    )
    assert made.status_code == 201, made.text
    key = httpx.post(
        f"{console_server.url}/admin/tenants/{made.json()['id']}/keys",
        json={"name": "k"},
        headers=console_server.admin(),
    )
    assert key.status_code == 201
    return str(made.json()["id"])


@pytest.fixture(scope="module")
def a_batch(console_server: ConsoleServer, tenant_id: str) -> str:
    """A batch of the tenant's, made through the openai SDK and run to its end: the Batches
    page shows a row with a badge, a progress bar and a file to download."""
    key = httpx.post(
        f"{console_server.url}/admin/tenants/{tenant_id}/keys",
        json={"name": "batch"},
        headers=console_server.admin(),
    ).json()["key"]
    client = openai.OpenAI(api_key=key, base_url=f"{console_server.url}/v1")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    file = client.files.create(file=("a.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    for _ in range(600):
        if (batch := client.batches.retrieve(batch.id)).output_file_id:
            return batch.id
        time.sleep(0.1)
    raise AssertionError(f"the batch never finished: {batch}")


def _open(page: Any, server: ConsoleServer, name: str, tenant_id: str) -> None:
    routes = {"tenant": f"#/tenants/{tenant_id}", "tenant-batches": f"#/batches?tenant={tenant_id}"}
    route = routes.get(name, f"#/{name}")
    page.goto(f"{server.url}/console{route}")
    page.locator("main h1").first.wait_for()
    page.wait_for_load_state("networkidle")


@pytest.fixture
def axe_page(browser: Any) -> Any:
    # axe is injected as a script of the test's: the console's CSP would (rightly) refuse it.
    context = browser.new_context(viewport=VIEWPORT, bypass_csp=True)
    yield context.new_page()
    context.close()


@pytest.mark.parametrize("name", ["sign-in", *PAGES])
def test_no_serious_accessibility_violation(
    axe_page: Any, console_server: ConsoleServer, tenant_id: str, a_batch: str, name: str
) -> None:
    if name == "sign-in":
        axe_page.goto(f"{console_server.url}/console")
        axe_page.get_by_label("Admin token").wait_for()
    else:
        sign_in(axe_page, console_server)
        _open(axe_page, console_server, name, tenant_id)
    axe_page.add_script_tag(path=str(AXE))
    result = axe_page.evaluate("async () => await axe.run(document)")
    serious = [
        f"{v['id']} ({v['impact']}): {v['help']} at {[n['target'] for n in v['nodes']][:3]}"
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert serious == []
    assert result["passes"], "axe ran no check"


@pytest.mark.parametrize("name", ["sign-in", *PAGES])
def test_every_control_is_reachable_by_keyboard(
    page: Any, console_server: ConsoleServer, tenant_id: str, a_batch: str, name: str
) -> None:
    if name == "sign-in":
        page.goto(f"{console_server.url}/console")
        page.get_by_label("Admin token").wait_for()
    else:
        sign_in(page, console_server)
        _open(page, console_server, name, tenant_id)
    # Mark every visible control, then Tab from the top and mark what takes the focus.
    total = page.evaluate(
        """(selector) => {
            const shown = [...document.querySelectorAll(selector)].filter(
                (el) => el.offsetParent !== null && getComputedStyle(el).visibility !== "hidden");
            shown.forEach((el, i) => el.dataset.control = String(i));
            return shown.length;
        }""",
        CONTROLS,
    )
    assert total > 0
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    reached: set[str] = set()
    for _ in range(total * 3 + 10):
        page.keyboard.press("Tab")
        control = page.evaluate("() => document.activeElement?.dataset.control ?? null")
        if control is not None:
            reached.add(control)
        if len(reached) == total:
            break
    missing = page.evaluate(
        """(reached) => [...document.querySelectorAll("[data-control]")]
            .filter((el) => !reached.includes(el.dataset.control))
            .map((el) => el.outerHTML.slice(0, 120))""",
        sorted(reached),
    )
    assert missing == []


def test_the_usage_page_makes_few_requests_on_load(
    page: Any, console_server: ConsoleServer, tenant_id: str
) -> None:
    sign_in(page, console_server)
    page.goto("about:blank")
    calls: list[str] = []
    page.on(
        "request",
        lambda request: (
            calls.append(request.url)
            if "/admin/" in request.url or "/console/api/" in request.url
            else None
        ),
    )
    page.goto(f"{console_server.url}/console#/usage")
    page.get_by_role("table", name="Usage by day").wait_for()
    page.wait_for_load_state("networkidle")
    assert len(calls) <= 3, calls
    screenshot(page, "usage-on-load")
