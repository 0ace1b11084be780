"""Gateway replicas are stateless: two `loragate serve` processes on one PostgreSQL database and
one Redis, in front of the same two `loragate engine`s (a models file's `urls`, routing
`affinity`), behave as one gateway.

- A tenant's rate limit set through one gateway holds across both: rpm N admits exactly N of
  a burst alternated between them, the rest are 429 with Retry-After.
- Every request that reached an engine, through either gateway, has exactly one usage row
  (complete, streamed, chat, an adapter's, a client that hung up mid-stream).
- A prefix's and an adapter's requests run on one engine whichever gateway takes them (the
  engines' own prefix-cache and LoRA counters say where), and one gateway's request finds the
  prefix the other's warmed.
- An engine SIGKILLed under streams through both gateways: each stream ends (finished, or with
  an error chunk of type `service_unavailable`, the 503 of a stream under way) with its usage
  row, and both gateways take the engine out of rotation and serve from the other.
- A gateway SIGKILLed under load, its ledger an hour from its next database write: each
  response it had sent whole was in its fsynced spool; the surviving gateway on the same
  spool directory adopts the dead one's segment and writes those rows, once. The streams it
  was serving are cut (they were never answered; the code promises no row for them), the
  engines abort their requests, and the surviving gateways serve on.

Not here: a `min_replicas: 0` model's local engine stopping when idle and starting again on
the next request is test_serve_models_cli.py's
test_a_model_that_scales_to_zero_has_an_engine_process_only_while_called (and
test_scale_to_zero.py); the ledger's spool replayed by a gateway restarted on it after a
SIGKILL, with local engines, is test_replicas.py's test_a_killed_gateway_loses_no_usage_row.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from engine_services import (
    LORAGATE_CLI,
    TOKEN,
    EngineService,
    metric_sum,
    start_engine,
    wait_healthy,
)
from live_server import TEST_SECRET, free_port

from bench.servers import wait_ready
from gateway.settings import Settings
from gateway.tenancy.admin_auth import mint_admin_token
from tests.conftest import REDIS, fresh_database

MODEL = "demo"
FLUSH_INTERVAL = "0.2"  # seconds between a gateway's usage writes to the database
TENANT_CACHE_TTL = 0.5  # seconds a gateway caches a tenant's limits


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def metric(self, name: str) -> float:
        return metric_sum(httpx.get(f"{self.url}/metrics", timeout=10).text, name)


@dataclass
class Cluster:
    gateways: list[Gateway]
    engines: list[EngineService]
    database_url: str
    models_file: Path
    flags: list[str]  # what every gateway of the cluster is started with
    root: Path
    tenant_id: str = ""
    key: str = ""
    adapter: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {mint_admin_token(Settings(secret_key=TEST_SECRET), 3600)}"}


@contextmanager
def _gateway(cluster: Cluster, name: str, *flags: str, replicas: int = 2) -> Iterator[Gateway]:
    """A `loragate serve` of the cluster (its own process group) until the block exits; ready
    once /health answers and `replicas` engines are linked."""
    port = free_port()
    cwd = cluster.root / name
    cwd.mkdir(exist_ok=True)
    command = [LORAGATE_CLI, "serve", "--models-config", str(cluster.models_file)]
    command += ["--port", str(port), *cluster.flags, *flags]
    log = cwd / "serve.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
            env=os.environ | {"LORAGATE_SECRET_KEY": TEST_SECRET, "PYTHONUNBUFFERED": "1"},
        )
    gateway = Gateway(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_ready(
            gateway.url,
            process,
            log,
            "/health",
            until=lambda: gateway.metric("loragate:engine_replicas") == replicas,
            timeout=120,
        )
        yield gateway
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stateless")


@pytest.fixture(scope="module")
def database_url(root: Path) -> Iterator[str]:
    """A PostgreSQL database of this module's own, dropped after."""
    with fresh_database("postgresql", root) as url:
        yield url


@pytest.fixture(scope="module")
def redis_prefix() -> Iterator[str]:
    """The limiter's key prefix of this module's own; its keys are deleted after. Skips (fails
    in CI, where LORAGATE_SERVICES_REQUIRED=1) without Redis."""
    client = redis.Redis.from_url(REDIS, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        if os.environ.get("LORAGATE_SERVICES_REQUIRED") == "1":
            raise
        pytest.skip(f"no Redis at {REDIS}: {exc}")
    prefix = f"lgtest-{secrets.token_hex(6)}"
    yield prefix
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="module")
def engines(demo_model_dir: Path, root: Path) -> Iterator[list[EngineService]]:
    """Two `loragate engine`s of the demo model on the gateways' adapter store (torch's
    kernels: what runs is not this module's subject, and the C++ ones may be compiling)."""
    started = [
        start_engine(demo_model_dir, root / "adapters", root / f"e{i}.log", "--no-cpu-kernels")
        for i in (0, 1)
    ]
    try:
        for engine in started:
            wait_healthy(engine)
        yield started
    finally:
        for engine in started:
            if engine.process.poll() is None:
                os.killpg(engine.process.pid, signal.SIGTERM)
                engine.process.wait(30)


@pytest.fixture(scope="module")
def cluster(
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    root: Path,
    database_url: str,
    redis_prefix: str,
    engines: list[EngineService],
) -> Iterator[Cluster]:
    """Gateways `a` (which migrates the database) and `b`; one tenant with a key, made through
    a's admin REST; the tenant's adapter `sticky`, registered through a."""
    models_file = root / "models.yaml"
    urls = ", ".join(e.url for e in engines)
    models_file.write_text(
        f"models:\n  - name: {MODEL}\n    path: {demo_model_dir}\n    urls: [{urls}]\n"
        "    engine: {max_model_len: 512}\n"
    )
    flags = ["--engine-token", TOKEN, "--routing", "affinity", "--database-url", database_url]
    # --redis-timeout 5: a stall on a busy machine must not fall back to per-gateway limits.
    flags += ["--redis-url", REDIS, "--redis-key-prefix", redis_prefix, "--redis-timeout", "5"]
    flags += ["--usage-spool-dir", str(root / "spool"), "--usage-flush-interval", FLUSH_INTERVAL]
    flags += ["--adapter-store", str(root / "adapters"), "--no-demo-tenant"]
    flags += ["--tenant-cache-ttl", str(TENANT_CACHE_TTL), "--spare-engines", "0"]
    state = Cluster([], engines, database_url, models_file, flags, root)
    with (
        _gateway(state, "a") as a,
        _gateway(state, "b", "--no-db-upgrade") as b,
        httpx.Client(base_url=a.url, headers=_admin(), timeout=60) as admin,
    ):
        state.gateways = [a, b]
        tenant = admin.post("/admin/tenants", json={"name": "shared"})
        assert tenant.status_code == 201, tenant.text
        state.tenant_id = tenant.json()["id"]
        key = admin.post(f"/admin/tenants/{state.tenant_id}/keys", json={})
        assert key.status_code == 201, key.text
        state.key = key.json()["key"]
        files = demo_adapters["r8-all"]
        adapter = admin.post(
            "/admin/adapters",
            data={"name": "sticky", "base_model": MODEL, "tenant_id": state.tenant_id},
            files={
                name: (name, (files / name).read_bytes())
                for name in ("adapter_config.json", "adapter_model.safetensors")
            },
        )
        assert adapter.status_code == 201, adapter.text
        state.adapter = "sticky"
        yield state


# -- requests -----------------------------------------------------------------------------------


def _complete(
    gateway: Gateway, cluster: Cluster, *, auth: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    """A completion (a chat one where `body` has messages) with the cluster's key, or `auth`."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0} | body
    headers = auth or cluster.auth
    return httpx.post(f"{gateway.url}{path}", json=body, headers=headers, timeout=60)


@dataclass
class Streamed:
    """What a client saw of a streamed response."""

    id: str | None = None
    chunks: int = 0
    error: dict[str, Any] | None = None  # the error chunk, if the stream carried one
    done: bool = False  # `data: [DONE]` arrived
    usage: dict[str, Any] | None = None
    ended_at: float = 0.0

    @property
    def whole(self) -> bool:
        """The client received the response to its end (an error chunk included)."""
        return self.done


def _stream(
    gateway: Gateway,
    cluster: Cluster,
    started: threading.Semaphore | None = None,
    hang_up_after: int | None = None,
    **body: Any,
) -> Streamed:
    """A streamed completion, read chunk by chunk; `started` is released at the third chunk;
    with `hang_up_after`, the client closes the connection after that many chunks."""
    seen = Streamed()
    body = {"model": MODEL, "temperature": 0, "stream": True} | body
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        with httpx.stream(
            "POST", f"{gateway.url}{path}", json=body, headers=cluster.auth, timeout=60
        ) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    seen.done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    seen.error = chunk["error"]
                    continue
                seen.id = seen.id or chunk["id"]
                seen.usage = chunk.get("usage") or seen.usage
                seen.chunks += 1
                if started is not None and seen.chunks == 3:
                    started.release()
                if hang_up_after is not None and seen.chunks >= hang_up_after:
                    break
    except httpx.HTTPError:
        pass  # the connection broke: `done` stays False
    seen.ended_at = time.monotonic()
    return seen


def _system_prompt(seed: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    return " ".join(words[(seed * 3 + i * 5) % len(words)] for i in range(60))


# -- the usage ledger in PostgreSQL -------------------------------------------------------------


def _rows(database_url: str, ids: list[str]) -> list[dict[str, Any]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        cursor = conn.execute(
            "SELECT request_id, status, prompt_tokens, cached_tokens, completion_tokens,"
            " adapter_name, model FROM usage WHERE request_id = ANY(%s)",
            (ids,),
        )
        names = [c.name for c in cursor.description or []]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _tenant_rows(database_url: str, tenant_id: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM usage WHERE tenant_id = %s", (tenant_id,))
        return int(row.fetchone()[0])  # type: ignore[index]


def _one_row_each(database_url: str, ids: list[str], timeout: float = 30.0) -> dict[str, Any]:
    """Each request's row, once every one has arrived (rows are written off the request path,
    every flush interval): fails if one is missing at the deadline or any comes twice."""
    assert len(set(ids)) == len(ids), ids
    deadline = time.monotonic() + timeout
    while True:
        rows = _rows(database_url, ids)
        if len(rows) >= len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    counts = Counter(r["request_id"] for r in rows)
    missing = [i for i in ids if counts[i] == 0]
    assert not missing, f"{len(missing)} of {len(ids)} requests have no usage row: {missing}"
    assert all(n == 1 for n in counts.values()), counts
    return {r["request_id"]: r for r in rows}


# -- 1. limits ----------------------------------------------------------------------------------


def test_a_tenants_rate_limit_holds_across_both_gateways(cluster: Cluster) -> None:
    """rpm 4, set through gateway b: of 12 requests alternated between a and b, 4 are served and
    8 refused with Retry-After; not 4 per gateway."""
    rpm = 4
    a, b = cluster.gateways
    patch = f"/admin/tenants/{cluster.tenant_id}"
    with httpx.Client(headers=_admin(), timeout=60) as admin:
        assert admin.patch(b.url + patch, json={"rpm_limit": rpm}).status_code == 200
        # The burst goes with a key made after the change, one that no gateway has cached: each
        # reads the tenant, new rpm and all, from the database on the key's first request. (With
        # the cluster's key, a would go on with the tenant it cached until --tenant-cache-ttl ran
        # out, and no answer shows a gateway's cached limits without spending a request.)
        made = admin.post(f"{b.url}/admin/tenants/{cluster.tenant_id}/keys", json={})
        assert made.status_code == 201, made.text
        fresh = {"Authorization": f"Bearer {made.json()['key']}"}
        try:
            started = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                answers = list(
                    pool.map(
                        lambda i: _complete(
                            (a, b)[i % 2], cluster, auth=fresh, prompt=f"limit {i}"
                        ),
                        range(12),
                    )
                )
            # The bucket refills one request every 60/rpm s: exact only within that.
            assert time.monotonic() - started < 60 / rpm
        finally:
            assert admin.patch(a.url + patch, json={"rpm_limit": None}).status_code == 200
            assert admin.delete(f"{a.url}/admin/keys/{made.json()['id']}").status_code == 200
            # Nothing to wait out for the tests after: the cluster's key was not used while the
            # limit was set, so what a gateway has cached for it, or reads next, has no rpm.
    codes = [r.status_code for r in answers]
    assert codes.count(200) == rpm and codes.count(429) == 12 - rpm, codes
    for refused in (r for r in answers if r.status_code == 429):
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    served = [r.json()["id"] for r in answers if r.status_code == 200]
    _one_row_each(cluster.database_url, served)


# -- 2. usage -----------------------------------------------------------------------------------


def test_every_request_through_either_gateway_has_exactly_one_usage_row(
    cluster: Cluster,
) -> None:
    """Whole answers, streamed or not, chat or completion, an adapter's, and a stream the client
    hung up on, through each gateway: one row each, with what the client was told it used;
    the tenant's rows grow by exactly that many."""
    before = _tenant_rows(cluster.database_url, cluster.tenant_id)
    told: dict[str, dict[str, Any]] = {}  # request id -> the usage the response reported
    hung_up: list[str] = []
    for gateway in cluster.gateways:
        for body in (
            {"prompt": "usage, plain"},
            {"messages": [{"role": "user", "content": "usage, chat"}]},
            {"prompt": "usage, adapter", "model": cluster.adapter},
        ):
            resp = _complete(gateway, cluster, **body)
            assert resp.status_code == 200, resp.text
            told[resp.json()["id"]] = resp.json()["usage"]
        streamed = _stream(
            gateway,
            cluster,
            prompt="usage, streamed",
            max_tokens=4,
            stream_options={"include_usage": True},
        )
        assert streamed.done and streamed.id and streamed.usage, streamed
        told[streamed.id] = streamed.usage
        left = _stream(
            gateway, cluster, hang_up_after=2, prompt="hang up", max_tokens=300, ignore_eos=True
        )
        assert left.id and not left.done
        hung_up.append(left.id)

    rows = _one_row_each(cluster.database_url, list(told) + hung_up)
    for request_id, usage in told.items():
        row = rows[request_id]
        assert row["status"] == "ok"
        assert (row["prompt_tokens"], row["completion_tokens"]) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        )
    assert {rows[i]["status"] for i in hung_up} == {"aborted"}
    assert all(0 < rows[i]["completion_tokens"] < 300 for i in hung_up)
    assert sum(r["adapter_name"] == cluster.adapter for r in rows.values()) == 2
    # Nothing more to come: no gateway holds a row not yet in the database.
    deadline = time.monotonic() + 30
    while any(g.metric("loragate:usage_rows_pending") for g in cluster.gateways):
        assert time.monotonic() < deadline, "usage rows still pending"
        time.sleep(0.05)
    after = _tenant_rows(cluster.database_url, cluster.tenant_id)
    assert after - before == len(rows)


# -- 3. affinity --------------------------------------------------------------------------------


def _ran_on(cluster: Cluster, send: Any) -> int:
    """The engine `send()`'s request ran on: the one whose prefix-cache lookups rose (every
    prompt is looked up on the engine that prefills it); fails if both or neither rose."""
    before = [e.metric("loragate:prefix_cache_queries_total") for e in cluster.engines]
    send()
    rose = [
        i
        for i, (engine, b) in enumerate(zip(cluster.engines, before, strict=True))
        if engine.metric("loragate:prefix_cache_queries_total") > b
    ]
    assert len(rose) == 1, rose
    return rose[0]


def _wait_resident(cluster: Cluster, engine_url: str, timeout: float = 10.0) -> None:
    """Until both gateways see the tenant's adapter in a slot of that engine, as they route by
    it (each engine reports what its slots hold at most every 0.1 s)."""
    deadline = time.monotonic() + timeout
    for gateway in cluster.gateways[:2]:
        while cluster.adapter not in _resident(gateway, engine_url):
            assert time.monotonic() < deadline, f"{gateway.url} never saw the adapter resident"
            time.sleep(0.02)


def _resident(gateway: Gateway, engine_url: str) -> list[str | None]:
    """The adapters `gateway`'s GET /admin/engines lists in the slots of that engine."""
    models = httpx.get(f"{gateway.url}/admin/engines", headers=_admin(), timeout=10).json()
    return [
        adapter["name"]
        for model in models["data"]
        for replica in model["replicas"]
        if replica["id"] == engine_url
        for adapter in replica["resident_adapters"]
    ]


def test_a_prefixs_and_an_adapters_requests_run_on_one_engine_through_either_gateway(
    cluster: Cluster,
) -> None:
    """Five system prompts, three requests each, taking turns between the gateways: each
    prompt's requests run on one engine, and each after the first finds the prefix the one
    before it (through the other gateway) left cached. (Gateways that ranked the engines each
    their own way would split a prompt's requests with odds of 1/2 per prompt.) Then six
    requests for the tenant's adapter, with distinct first blocks (prefix affinity alone would
    spread them), alternated likewise, run where the adapter is: on one engine, which read it
    from disk once at most."""
    tag = secrets.token_hex(4)  # prefixes no earlier run cached
    engines_of: dict[int, set[int]] = {p: set() for p in range(5)}
    cached: dict[int, list[int]] = {p: [] for p in range(5)}
    for turn in range(3):
        for p in range(5):
            gateway = cluster.gateways[(p + turn) % 2]
            messages = [
                {"role": "system", "content": f"{tag} {p} {_system_prompt(p)}"},
                {"role": "user", "content": f"question {turn}"},
            ]

            def send(gateway: Gateway = gateway, messages: Any = messages, p: int = p) -> None:
                resp = _complete(gateway, cluster, messages=messages)
                assert resp.status_code == 200, resp.text
                cached[p].append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

            engines_of[p].add(_ran_on(cluster, send))
    assert all(len(engines) == 1 for engines in engines_of.values()), engines_of
    assert all(n[0] == 0 and min(n[1:]) >= 48 for n in cached.values()), cached

    loads = sum(e.metric("loragate:lora_loads_total") for e in cluster.engines)
    ran_on = set()
    for turn in range(6):
        gateway = cluster.gateways[turn % 2]
        prompt = f"{tag} {turn} " + _system_prompt(turn + 10)

        def adapted(gateway: Gateway = gateway, prompt: str = prompt) -> None:
            resp = _complete(gateway, cluster, model=cluster.adapter, prompt=prompt)
            assert resp.status_code == 200, resp.text

        engine = _ran_on(cluster, adapted)
        ran_on.add(engine)
        _wait_resident(cluster, cluster.engines[engine].url)
    assert len(ran_on) == 1, ran_on
    assert sum(e.metric("loragate:lora_loads_total") for e in cluster.engines) - loads <= 1


# -- 4. an engine killed ------------------------------------------------------------------------


def _long_streams(
    cluster: Cluster, gateways: list[Gateway], tag: str
) -> tuple[ThreadPoolExecutor, list[Any], threading.Semaphore]:
    """One stream of 300 tokens per entry of `gateways`, each with a prompt of its own."""
    started = threading.Semaphore(0)
    threads = ThreadPoolExecutor(len(gateways))
    futures = [
        threads.submit(
            _stream,
            gateway,
            cluster,
            started,
            prompt=f"{tag} {i} " + _system_prompt(i + 20),
            max_tokens=300,
            ignore_eos=True,
        )
        for i, gateway in enumerate(gateways)
    ]
    return threads, futures, started


def test_an_engine_killed_under_load_through_both_gateways_loses_no_usage_row(
    cluster: Cluster,
) -> None:
    """SIGKILL the busier engine while 8 streams (4 per gateway) run on the two: the streams on
    it end with a 503 in the stream, the others finish, each has one usage row; then both
    gateways serve new requests from the survivor."""
    tag = secrets.token_hex(4)
    threads, futures, started = _long_streams(cluster, cluster.gateways * 4, tag)
    with threads:
        for _ in futures:  # every stream under way: none can move to the other engine now
            assert started.acquire(timeout=60)
        running = [e.metric("loragate:num_requests_running") for e in cluster.engines]
        victim = cluster.engines[running.index(max(running))]
        os.killpg(victim.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results: list[Streamed] = [f.result(timeout=120) for f in futures]
    victim.process.wait(10)

    assert all(r.whole and r.id for r in results), results  # the gateways ended every stream
    failed = [r for r in results if r.error is not None]
    assert failed, f"no stream ran on the killed engine ({running})"
    assert {r.error["type"] for r in failed if r.error} == {"service_unavailable"}, failed
    assert max(r.ended_at for r in failed) - killed_at < 5.0

    rows = _one_row_each(cluster.database_url, [r.id for r in results if r.id])
    for result in results:
        row = rows[result.id]
        assert row["status"] == ("error" if result.error else "ok"), (row, result)
        if result.error is None:
            assert row["completion_tokens"] == 300

    for gateway in cluster.gateways:  # out of rotation; prompts that hashed to it go on
        assert gateway.metric("loragate:engine_replicas") == 1
        for i in range(3):
            resp = _complete(gateway, cluster, prompt=f"{tag} after {i} " + _system_prompt(i))
            assert resp.status_code == 200, resp.text


# -- 5. a gateway killed ------------------------------------------------------------------------


def test_a_gateway_killed_under_load_loses_no_row_of_a_response_it_sent_whole(
    cluster: Cluster,
) -> None:
    """Gateway c (its ledger writes to the database only every 60 s) answers 5 requests whole,
    then SIGKILL while it and gateway a each stream 4: c's answered rows were only in its
    spool; a adopts c's segment and writes them, once each, with a's own streams'; c's cut
    streams' engine requests are aborted; a and b serve on."""
    a, b = cluster.gateways
    alive = sum(e.process.poll() is None for e in cluster.engines)
    tag = secrets.token_hex(4)
    c_flags = ("--no-db-upgrade", "--usage-flush-interval", "60")
    with _gateway(cluster, "c", *c_flags, replicas=alive) as c:
        answered = []
        for i in range(3):
            resp = _complete(c, cluster, prompt=f"{tag} c {i}")
            assert resp.status_code == 200, resp.text
            answered.append(resp.json()["id"])
        for i in range(2):
            streamed = _stream(c, cluster, prompt=f"{tag} c stream {i}", max_tokens=4)
            assert streamed.done and streamed.id
            answered.append(streamed.id)

        threads, futures, started = _long_streams(cluster, [c, a] * 4, tag)
        with threads:
            for _ in futures:
                assert started.acquire(timeout=60)
            spool = cluster.root / "spool"
            assert [p for p in spool.iterdir() if p.name.startswith(f"usage-{c.process.pid}-")]
            # Nothing of c's reached the database yet: its rows are in its segment alone. (Asked
            # before the kill: once c is dead, a may adopt the segment before any look after.)
            assert _rows(cluster.database_url, answered) == []
            os.killpg(c.process.pid, signal.SIGKILL)
            c.process.wait(10)
            results: list[Streamed] = [f.result(timeout=120) for f in futures]
        dead_pid = c.process.pid

    through_c, through_a = results[0::2], results[1::2]
    assert not any(r.done for r in through_c), through_c  # cut: never answered
    assert all(r.done and r.error is None for r in through_a), through_a
    rows = _one_row_each(cluster.database_url, answered + [r.id for r in through_a if r.id])
    assert all(rows[r.id]["completion_tokens"] == 300 for r in through_a if r.id)
    # The cut streams were never answered: the code promises them no row (the dead gateway
    # would have written it at their end), only never two.
    cut = Counter(r["request_id"] for r in _rows(cluster.database_url, [r.id for r in through_c]))
    assert all(n <= 1 for n in cut.values()), cut

    deadline = time.monotonic() + 10
    while any(p.name.startswith(f"usage-{dead_pid}-") for p in spool.iterdir()):
        assert time.monotonic() < deadline, sorted(p.name for p in spool.iterdir())
        time.sleep(0.1)  # drained, then removed by the adopter
    deadline = time.monotonic() + 10
    while sum(e.metric("loragate:num_requests_running") for e in _alive(cluster)) > 0:
        assert time.monotonic() < deadline, "the engines still run the dead gateway's requests"
        time.sleep(0.1)

    assert sum(e.process.poll() is None for e in cluster.engines) == alive
    for gateway in (a, b):
        resp = _complete(gateway, cluster, prompt=f"{tag} after the gateway")
        assert resp.status_code == 200, resp.text


def _alive(cluster: Cluster) -> list[EngineService]:
    return [e for e in cluster.engines if e.process.poll() is None]
