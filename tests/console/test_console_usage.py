"""The usage page's numbers are the ledger's: with 14 tenants over five days (so that the top 10
and "other" both show), every row of the page's table, its legend and its CSV equal
`/admin/usage` for the same range and grouping, token for token."""

from __future__ import annotations

import csv
import io
import random
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_server import MODEL, ConsoleServer, screenshot, sign_in
from playwright.sync_api import expect

FIRST_DAY = datetime(2026, 10, 1, tzinfo=UTC)
DAYS = 5
TENANTS = 14


@pytest.fixture(scope="module")
def seeded(console_server: ConsoleServer) -> None:
    """Usage rows written into the server's database as its ledger writes them: one real
    request's row gives the columns' formats."""
    answer = httpx.post(
        f"{console_server.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {console_server.demo_key}"},
        timeout=60,
    )
    assert answer.status_code == 200
    database = console_server.cwd / "loragate.db"
    with sqlite3.connect(database) as db:
        for _ in range(100):
            row = db.execute("SELECT * FROM usage LIMIT 1").fetchone()
            if row is not None:
                break
            time.sleep(0.05)  # the ledger writes within --usage-flush-interval
        columns = [c[1] for c in db.execute("PRAGMA table_info(usage)")]
        template = dict(zip(columns, row, strict=True))
        rng = random.Random(7)
        rows = []
        for n in range(400):
            when = FIRST_DAY + timedelta(seconds=rng.randrange(DAYS * 86400))
            rows.append(
                template
                | {
                    "request_id": f"seeded-{n}",
                    "tenant_id": f"ten_seed{rng.randrange(TENANTS):02d}",
                    "prompt_tokens": rng.randrange(1, 5000),
                    "cached_tokens": 0,
                    "completion_tokens": rng.randrange(1, 2000),
                    "created_at": _like(template["created_at"], when),
                    "created_epoch": int(when.timestamp()),
                }
            )
        marks = ", ".join("?" for _ in columns)
        db.executemany(
            f"INSERT INTO usage ({', '.join(columns)}) VALUES ({marks})",
            [tuple(r[c] for c in columns) for r in rows],
        )


def _like(example: Any, when: datetime) -> Any:
    """`when` in the format the database stores its times in."""
    if isinstance(example, str):
        parsed = datetime.fromisoformat(example)
        naive = parsed.tzinfo is None
        value = when.replace(tzinfo=None) if naive else when
        return value.isoformat(sep=" " if " " in example else "T")
    return example


def _api(server: ConsoleServer, group: str) -> list[dict[str, Any]]:
    params = [
        ("from", FIRST_DAY.date().isoformat()),
        ("to", (FIRST_DAY + timedelta(days=DAYS)).date().isoformat()),
        ("group_by", "day"),
        ("group_by", group),
        ("top", "10"),
    ]
    answer = httpx.get(f"{server.url}/admin/usage", params=params, headers=server.admin())
    assert answer.status_code == 200, answer.text
    return list(answer.json()["data"])


def _label(row: dict[str, Any], group: str) -> str:
    if row["other"]:
        return "other"
    return row[group] if row[group] is not None else "(base model)"


@pytest.mark.usefixtures("seeded")
def test_the_page_shows_the_ledgers_numbers(page: Any, console_server: ConsoleServer) -> None:
    sign_in(page, console_server)
    page.get_by_role("link", name="Usage").click()
    page.get_by_label("From").fill(FIRST_DAY.date().isoformat())
    page.get_by_label("To (inclusive)").fill(
        (FIRST_DAY + timedelta(days=DAYS - 1)).date().isoformat()
    )
    page.get_by_label("Stack by").select_option("tenant")
    page.get_by_role("button", name="Show").click()
    expect(page.locator("#usage-summary")).to_contain_text(FIRST_DAY.date().isoformat())

    api = _api(console_server, "tenant")
    assert sum(r["other"] for r in api) == DAYS  # the four smallest tenants, each day
    expected = sorted(
        (
            r["day"],
            _label(r, "tenant"),
            r["num_requests"],
            r["prompt_tokens"],
            r["completion_tokens"],
            r["prompt_tokens"] + r["completion_tokens"],
        )
        for r in api
    )
    table = page.get_by_role("table", name="Usage by day")
    expect(table.locator("tbody tr")).to_have_count(len(api))
    shown = sorted(
        (c[0], c[1], *(int(x.replace(",", "")) for x in c[2:]))
        for c in (row.locator("td").all_inner_texts() for row in table.locator("tbody tr").all())
    )
    assert shown == expected
    # The legend: the top 10 by tokens, most first, then other.
    totals: dict[str, int] = {}
    for r in api:
        label = _label(r, "tenant")
        totals[label] = totals.get(label, 0) + r["prompt_tokens"] + r["completion_tokens"]
    top = sorted((t for t in totals if t != "other"), key=lambda t: -totals[t])
    expect(page.get_by_role("list", name="Chart legend").locator("li")).to_have_text(
        [*top, "other"]
    )
    total = sum(totals.values())
    expect(page.locator("#usage-summary")).to_contain_text(f"{total:,} tokens")
    screenshot(page, "usage-top-10")

    with page.expect_download() as download:
        page.get_by_role("button", name="Export CSV").click()
    exported = sorted(
        (
            r["day"],
            r["tenant"],
            int(r["num_requests"]),
            int(r["prompt_tokens"]),
            int(r["completion_tokens"]),
            int(r["total_tokens"]),
        )
        for r in csv.DictReader(io.StringIO(Path(download.value.path()).read_text()))
    )
    assert exported == expected
