"""Batches survive what stops a gateway, as `loragate serve` processes: a gateway SIGKILLed with
its batch half done and started again on the same database completes it, with no custom_id
twice in the output and one usage row a line, whose sums are the output's; two gateways on one
PostgreSQL database share a batch, each running some of its lines and none running one twice.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import sqlalchemy as sa
from live_server import ServeProcess, new_tenant, serve_process, usage_rows

from tenants.db import async_url

MODEL = "demo"
ENDED = ("completed", "failed", "expired", "cancelled")
LINES = 40
# Each gateway runs its engine loop in a thread of its own process; it keeps 4 lines in it,
# and a claim it stops renewing lapses after 2 s.
FLAGS = ("--no-engine-process", "--batch-max-concurrency", "4", "--batch-lease-seconds", "2")


def _client(gateway: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=2, timeout=60)


def _lines() -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": MODEL,
                "prompt": f"Story number {n}",
                "max_tokens": 96,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for n in range(LINES)
    ]


def _start(client: openai.OpenAI) -> str:
    data = "".join(json.dumps(line) + "\n" for line in _lines()).encode()
    file_id = client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    )
    return batch.id


def _wait(client: openai.OpenAI, batch_id: str, done: Any, timeout: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"{batch_id}: {batch}"
        time.sleep(0.1)


def _check_output(client: openai.OpenAI, batch: Any, database_url: str) -> None:
    """Every line once in the output, one usage row each, their sums the output's."""
    assert batch.status == "completed" and batch.error_file_id is None
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    ids = [line["custom_id"] for line in output]
    assert ids == [f"line-{n}" for n in range(LINES)]  # in input order, each once
    rows = usage_rows(database_url, batch_id=batch.id)
    assert sorted(r["request_id"] for r in rows) == sorted(
        f"{batch.id}-{n}" for n in range(1, LINES + 1)
    )
    usages = [line["response"]["body"]["usage"] for line in output]
    for name in ("prompt_tokens", "completion_tokens"):
        assert sum(r[name] for r in rows) == sum(u[name] for u in usages)
    assert all(u["completion_tokens"] == 96 for u in usages)


def _lines_table(database_url: str, batch_id: str) -> list[dict[str, Any]]:
    url = sa.engine.make_url(async_url(database_url))
    sync = {"sqlite+aiosqlite": "sqlite", "postgresql+asyncpg": "postgresql+psycopg"}
    engine = sa.create_engine(url.set(drivername=sync[url.drivername]))
    try:
        with engine.connect() as conn:
            table = sa.Table("batch_lines", sa.MetaData(), autoload_with=conn)
            query = sa.select(table.c.line, table.c.claimed_by, table.c.attempts).where(
                table.c.batch_id == batch_id
            )
            return [dict(row._mapping) for row in conn.execute(query)]
    finally:
        engine.dispose()


def test_a_gateway_killed_mid_batch_and_restarted_completes_it_once(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'gw' / 'loragate.db'}"
    with serve_process(demo_model_dir, tmp_path / "gw", *FLAGS) as gw:
        _, key = new_tenant(gw, "batches")
        client = _client(gw, key)
        batch_id = _start(client)
        half = _wait(client, batch_id, lambda b: b.request_counts.completed >= LINES // 2)
        assert half.status == "in_progress"
        os.killpg(gw.pid, signal.SIGKILL)
    claimed = _lines_table(database_url, batch_id)
    assert any(line["attempts"] == 0 for line in claimed)  # killed with lines left to run
    with serve_process(demo_model_dir, tmp_path / "gw", *FLAGS) as again:
        client = _client(again, key)
        done = _wait(client, batch_id, lambda b: b.status in ENDED)
        _check_output(client, done, database_url)
    workers = {line["claimed_by"] for line in _lines_table(database_url, batch_id)}
    assert len(workers) == 2  # the killed gateway's lines, and the restarted one's


def test_two_gateways_on_postgresql_share_a_batch(
    demo_model_dir: Path, postgres_url: str, tmp_path: Path
) -> None:
    # One database, and one store of files (a shared volume, as on Kubernetes).
    shared = (*FLAGS, "--database-url", postgres_url, "--adapter-store", str(tmp_path / "store"))
    with (
        serve_process(demo_model_dir, tmp_path / "a", *shared) as first,
        serve_process(demo_model_dir, tmp_path / "b", *shared, "--no-db-upgrade") as second,
    ):
        _, key = new_tenant(first, "shared-batches")
        batch_id = _start(_client(first, key))
        done = _wait(_client(second, key), batch_id, lambda b: b.status in ENDED)
        _check_output(_client(second, key), done, postgres_url)
    lines = _lines_table(postgres_url, batch_id)
    assert all(line["attempts"] == 1 for line in lines)  # none run twice
    by_worker: dict[str, int] = {}
    for line in lines:
        by_worker[line["claimed_by"]] = by_worker.get(line["claimed_by"], 0) + 1
    assert len(by_worker) == 2, by_worker  # both gateways ran some of it
