"""`loragate serve` processes as operators run them: two replicas on one Redis and one
PostgreSQL hold a tenant's limit exactly (not once per replica), and a gateway killed with
SIGKILL loses no usage row of a request it answered."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from live_server import new_tenant, serve_process, usage_rows, wait_for_usage

MODEL = "demo"
# Each gateway runs its engine loop in a thread of its own process.
IN_PROCESS = "--no-engine-process"


def _complete(url: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        timeout=60,
    )


def test_two_replicas_on_one_redis_hold_the_limit_exactly(
    demo_model_dir: Path, postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    """LiteLLM #40291: a limiter that reads local memory and writes Redis admits the limit
    once per replica. Here rpm 5 admits 5 of a burst sent through both replicas, not 10."""
    database_url = postgres_url
    # --redis-timeout 5: a stall on a busy machine must not fall back to per-replica limits.
    shared = ("--database-url", database_url, "--redis-url", redis_url, "--redis-timeout", "5")
    with (
        serve_process(demo_model_dir, tmp_path / "a", IN_PROCESS, *shared) as first,
        serve_process(
            demo_model_dir, tmp_path / "b", IN_PROCESS, *shared, "--no-db-upgrade"
        ) as second,
    ):
        a, b = first.url, second.url
        tenant_id, key = new_tenant(first, "replicated", rpm_limit=5)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _complete((a, b)[i % 2], key), range(24)))
        codes = [r.status_code for r in answers]
        assert codes.count(200) == 5 and codes.count(429) == 19, codes
        refused = [r for r in answers if r.status_code == 429]
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
        wait_for_usage(database_url, 5, tenant_id=tenant_id)


def test_a_killed_gateway_loses_no_usage_row(
    demo_model_dir: Path, database_url: str, tmp_path: Path
) -> None:
    """SIGKILL after N answered requests, with the database writer an hour away from its
    next batch: every row was in the fsynced spool before its answer went out, and the
    restarted gateway writes all N."""
    database = (IN_PROCESS, "--database-url", database_url)
    answered = []
    flags = (*database, "--usage-flush-interval", "60")
    with serve_process(demo_model_dir, tmp_path / "gw", *flags) as gw:
        tenant_id, key = new_tenant(gw, "killed")
        for _ in range(8):
            resp = _complete(gw.url, key)
            assert resp.status_code == 200
            answered.append(resp.json()["id"])
        stream = httpx.post(
            f"{gw.url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True},
            timeout=60,
        )
        assert stream.text.rstrip().endswith("data: [DONE]")
        first_chunk = stream.text.split("\n\n", 1)[0].removeprefix("data: ")
        answered.append(json.loads(first_chunk)["id"])
        assert usage_rows(database_url, tenant_id=tenant_id) == []  # only in the spool yet
        os.killpg(gw.pid, signal.SIGKILL)
    with serve_process(demo_model_dir, tmp_path / "gw", *database, "--usage-flush-interval", "0.2"):
        rows = wait_for_usage(database_url, len(answered), tenant_id=tenant_id)
    assert sorted(r["request_id"] for r in rows) == sorted(answered)
