"""Per-tenant limits and quotas through HTTP with the openai client, and the usage row every
request that reached the engine leaves behind: on PostgreSQL with Redis, and on SQLite with
the in-process limiter."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from held_engine import HELD_MAX_TOKENS, HoldingEngine
from live_server import Server, build_test_app, live_server, new_tenant, wait_for_usage

from engine.frontend.async_engine import AsyncEngine
from engine.messages import EngineRequest
from engine.request import SamplingParams
from tests.conftest import fresh_database
from tests.engine.poison import PoisonedParams

MODEL = "demo"
POISON_MAX_TOKENS = 13  # a request asking for this many tokens fails in an engine step


class PoisoningEngine:
    """The real engine, with one fault injected: a request with max_tokens 13 makes its third
    sampling step raise (the engine contains it: that request fails alone). Requests of
    HELD_MAX_TOKENS are held until their client gives up (held_engine)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = HoldingEngine(engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        params = request.params
        if params.max_tokens == POISON_MAX_TOKENS:
            fields = {f: getattr(params, f) for f in SamplingParams.__dataclass_fields__}
            request = replace(request, params=PoisonedParams(**fields, fail_from=3))
        return self._engine.generate(request)


@pytest.fixture(params=["sqlite-local", "postgresql-redis"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str | None]]:
    """(database URL, Redis URL or None): the embedded default, and the replicated one."""
    kind = request.param.split("-")[0]
    redis_url = request.getfixturevalue("redis_url") if kind == "postgresql" else None
    with fresh_database(kind, tmp_path) as database_url:
        yield database_url, redis_url


@pytest.fixture
def server(
    tenancy_engine: AsyncEngine, demo_model_dir: Path, stack: tuple[str, str | None], tmp_path: Path
) -> Iterator[Server]:
    database_url, redis_url = stack
    app = build_test_app(
        PoisoningEngine(tenancy_engine),  # type: ignore[arg-type]
        MODEL,
        tmp_path,
        demo_model_dir,
        database_url,
        settings={"redis_url": redis_url},
        metrics_max_tenants=3,
    )
    with live_server(app, tenancy_engine) as server:
        yield server


def _client(server: Server, key: str) -> openai.OpenAI:
    return server.client(api_key=key)


def _complete(client: openai.OpenAI, **extra: Any) -> Any:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    return client.completions.with_raw_response.create(**(body | extra))


def _database(server: Server) -> str:
    return str(server.tenancy.settings.database_url)


def test_rpm_admits_exactly_the_limit_then_429_with_retry_after(server: Server) -> None:
    tenant_id, key = new_tenant(server, "rpm", rpm_limit=3)
    client = _client(server, key)
    remaining = []
    for _ in range(3):
        raw = _complete(client)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
        assert raw.headers["x-ratelimit-reset-requests"]
    assert remaining == [2, 1, 0]
    with pytest.raises(openai.RateLimitError) as refused:
        _complete(client)
    error = refused.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded" and "requests per minute" in error["message"]
    # One request frees every 20 s (3 per minute): the wait is that, not a constant.
    retry_after = int(refused.value.response.headers["retry-after"])
    assert 15 <= retry_after <= 21
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    # Three rows, not four: a refusal before the engine is counted in metrics instead.
    assert len(wait_for_usage(_database(server), 3, tenant_id=tenant_id)) == 3
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert re.search(r'loragate:requests_rejected_total\{status="429"\} [1-9]', metrics)
    limited = f'code="rate_limit_exceeded",tenant="{tenant_id}"'  # labels in sorted order
    assert f"loragate:tenant_rate_limited_total{{{limited}}} 1.0" in metrics


def test_tpm_reserves_max_tokens_and_keeps_only_what_was_used(server: Server) -> None:
    _, key = new_tenant(server, "tpm", tpm_limit=600)  # refills 10 tokens a second
    client = _client(server, key)
    # Without max_tokens a chat reserves the rest of the context: more than 600 tokens.
    with pytest.raises(openai.RateLimitError) as too_large:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" in too_large.value.response.json()["error"]["message"]
    started = time.monotonic()
    first = _complete(client, max_tokens=200, stop=[" "])  # stops early: uses far less
    used = first.parse().usage.total_tokens
    reserved_first = first.parse().usage.prompt_tokens + 200
    assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 600 - reserved_first + 1
    second = _complete(client, max_tokens=100)
    refill = 10 * (time.monotonic() - started) + 1
    reserved_second = second.parse().usage.prompt_tokens + 100
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    # Refunded to the actual count: the first request holds `used`, not `reserved_first`.
    assert 600 - used - reserved_second <= remaining <= 600 - used - reserved_second + refill
    assert used < reserved_first - refill


def test_a_spent_monthly_quota_is_insufficient_quota(server: Server) -> None:
    tenant_id, key = new_tenant(server, "quota", monthly_token_quota=20)
    client = _client(server, key)
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    with pytest.raises(openai.RateLimitError) as refused:
        _complete(client)
    error = refused.value.response.json()["error"]
    assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
    # Until the month turns: more than a second, at most 31 days.
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 31 * 86400
    with httpx.Client(base_url=server.base_url, headers=server.admin_headers) as admin:
        lifted = admin.patch(f"/admin/tenants/{tenant_id}", json={"monthly_token_quota": None})
        assert lifted.status_code == 200 and lifted.json()["monthly_token_quota"] is None
    assert _complete(client).status_code == 200


def _stream_then_hang_up(server: Server, key: str, after_chunks: int) -> None:
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 200, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json=body | {"stream": True},
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= after_chunks:
                break  # closing the response hangs up mid-stream


def _in_flight(server: Server, tenant_id: str) -> int:
    return int(server.run(server.app.state.tenancy.limiter.in_flight(tenant_id)))


def test_concurrency_is_released_however_a_request_ends(server: Server) -> None:
    tenant_id, key = new_tenant(server, "conc", max_concurrency=2)
    client = _client(server, key)
    ends: dict[str, str] = {}
    # Finished, whole and streamed.
    ends[_complete(client).parse().id] = "ok"
    with client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, stream=True, temperature=0
    ) as stream:
        ends[next(iter(stream)).id] = "ok"
        for _ in stream:
            pass
    # The client hangs up mid-stream, and right after the headers.
    _stream_then_hang_up(server, key, after_chunks=3)
    _stream_then_hang_up(server, key, after_chunks=0)
    # Refused by the engine after admission: prompt + max_tokens past the context.
    with pytest.raises(openai.BadRequestError) as long:
        _complete(client, prompt=[5] * 1000, max_tokens=100)
    assert long.value.response.json()["error"]["code"] == "context_length_exceeded"
    # Failed in an engine step, whole and streamed.
    with pytest.raises(openai.InternalServerError):
        _complete(client, max_tokens=POISON_MAX_TOKENS)
    with (
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=POISON_MAX_TOKENS, stream=True
        ) as stream,
        pytest.raises(openai.APIError),
    ):
        for _ in stream:
            pass
    # A whole request whose client gave up waiting.
    with pytest.raises(openai.APITimeoutError):
        server.client(api_key=key).with_options(timeout=0.2).completions.create(
            model=MODEL, prompt="slow", max_tokens=HELD_MAX_TOKENS, extra_body={"ignore_eos": True}
        )
    deadline = time.monotonic() + 30
    while _in_flight(server, tenant_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _in_flight(server, tenant_id) == 0
    # Every request that reached the engine left one row (7 of them), ending as it did.
    rows = wait_for_usage(_database(server), 7, tenant_id=tenant_id)
    statuses = sorted(r["status"] for r in rows)
    assert statuses == ["aborted"] * 3 + ["error"] * 2 + ["ok"] * 2, statuses
    for request_id, status in ends.items():
        assert [r["status"] for r in rows if r["request_id"] == request_id] == [status]
    # And the limit still admits two at once.
    assert _complete(client).status_code == 200
    assert server.wait_all_blocks_free()


def test_a_request_stopped_mid_stream_is_billed_for_what_it_generated(server: Server) -> None:
    tenant_id, key = new_tenant(server, "billed")
    _stream_then_hang_up(server, key, after_chunks=5)
    (row,) = wait_for_usage(_database(server), 1, tenant_id=tenant_id)
    assert row["status"] == "aborted" and row["completion_tokens"] >= 4
    assert row["prompt_tokens"] > 0 and row["latency"] > 0 and row["ttft"] is not None


def test_summed_usage_equals_what_the_responses_reported(server: Server) -> None:
    tenant_id, key = new_tenant(server, "sums")
    client = _client(server, key)
    reported: dict[str, Any] = {}
    for i in range(6):
        resp = client.completions.create(
            model=MODEL, prompt=["Tell me", "a story"][: 1 + i % 2], max_tokens=3 + i, n=1 + i % 3
        )
        reported[resp.id] = resp.usage
    for i in range(4):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(chat)
        reported[chunks[-1].id] = chunks[-1].usage
    rows = {r["request_id"]: r for r in wait_for_usage(_database(server), 10, tenant_id=tenant_id)}
    assert set(rows) == set(reported)
    for request_id, usage in reported.items():
        row = rows[request_id]
        assert row["prompt_tokens"] == usage.prompt_tokens
        assert row["completion_tokens"] == usage.completion_tokens
        assert row["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
        assert row["status"] == "ok" and row["model"] == MODEL
    summed = httpx.get(
        f"{server.base_url}/v1/usage", headers={"Authorization": f"Bearer {key}"}
    ).json()["data"][0]
    assert summed["num_requests"] == 10
    assert summed["prompt_tokens"] == sum(u.prompt_tokens for u in reported.values())
    assert summed["completion_tokens"] == sum(u.completion_tokens for u in reported.values())


def test_rejections_write_no_row_and_tenant_series_are_bounded(server: Server) -> None:
    tenants = [new_tenant(server, f"series-{i}") for i in range(5)]
    for _, key in tenants:
        assert _complete(_client(server, key)).status_code == 200
    _, key = tenants[0]
    bad = [
        httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x"}),
        httpx.post(
            f"{server.base_url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "no-such-model", "prompt": "x"},
        ),
        httpx.post(
            f"{server.base_url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "x", "temperature": -1},
        ),
    ]
    assert [r.status_code for r in bad] == [401, 404, 400]
    # The ledger writes in order: once a request sent after them has its row, a row of
    # theirs would be there too.
    assert _complete(_client(server, key)).status_code == 200
    assert len(wait_for_usage(_database(server), 6)) == 6
    metrics = httpx.get(f"{server.base_url}/metrics").text
    for status in ("401", "404", "400"):
        assert f'loragate:requests_rejected_total{{status="{status}"}}' in metrics
    # --metrics-max-tenants 3: the first three tenants seen have series, the rest are `other`.
    series = r'loragate:tenant_requests_total\{status="ok",tenant="([^"]+)"\} ([\d.]+)'
    counts = {tenant: float(n) for tenant, n in re.findall(series, metrics)}
    assert len(counts) == 4 and counts["other"] == 2


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_going_quiet_falls_back_or_refuses(
    tenancy_engine: AsyncEngine,
    demo_model_dir: Path,
    postgres_url: str,
    redis_url: str,
    tmp_path: Path,
    mode: str,
) -> None:
    database_url = postgres_url
    app = build_test_app(
        tenancy_engine,
        MODEL,
        tmp_path,
        demo_model_dir,
        database_url,
        settings={"redis_url": redis_url, "redis_failure_mode": mode},
    )
    with live_server(app, tenancy_engine) as server:
        tenant_id, key = new_tenant(server, "quiet", rpm_limit=6)
        client = _client(server, key)
        assert _complete(client).status_code == 200
        quiet = redis.Redis.from_url(redis_url)
        quiet.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        try:
            if mode == "open":
                assert _complete(client).status_code == 200  # limited in process meanwhile
                metrics = httpx.get(f"{server.base_url}/metrics").text
                assert "loragate:ratelimit_fallback_active 1.0" in metrics
            else:
                with pytest.raises(openai.APIStatusError) as refused:
                    _complete(client)
                assert refused.value.status_code == 503
                assert int(refused.value.response.headers["retry-after"]) >= 1
        finally:
            quiet.execute_command("CLIENT", "UNPAUSE")
        # Redis answers again: the limiter goes back to it. Waited out, not polled: it tries
        # Redis once a probe interval (1 s), and each try is a request the rpm limit counts.
        time.sleep(1.2)
        assert _complete(client).status_code == 200
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert "loragate:ratelimit_fallback_active 0.0" in metrics
        assert re.search(r"loragate:ratelimit_redis_errors_total [1-9]", metrics)
        # The request after went to Redis: the tenant's bucket is there (for 10 s a request).
        assert quiet.pttl(f"loragate:{{{tenant_id}}}:rpm") > 0
