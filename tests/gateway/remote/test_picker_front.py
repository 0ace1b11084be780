"""The tenant-facing gateway in front of an inference gateway (models-file `routing: picker`):
every request goes to the one address, each on its own HTTP request, and what stands there
chooses the engine. On Kubernetes that is the Gateway API Inference Extension's endpoint
picker behind Envoy; neither runs here, so a real nginx load-balancing over two real
`loragate engine`s stands in for it (it picks per request too, round-robin), and its access
log keeps each body as the picker would read it.

- Requests through the one address spread over both engines (a WebSocket link would have
  pinned them to one), answer as a direct engine does, streamed and not, an adapter's too;
  each body the picker sees is a completions request naming the adapter's id or the model and
  carrying the prompt's text.
- A client that hangs up mid-stream frees its sequence on the engine that ran it.
- With no engine up behind the address (KEDA's pool at zero) a request is held, counted in
  `loragate:model_pending_requests` (the signal that wakes the pool), answered once an engine
  comes up; past `--max-pending-per-model`, a 503 with Retry-After.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_services import (
    LORAGATE_CLI,
    TOKEN,
    EngineService,
    metric_sum,
    start_engine,
    wait_healthy,
)
from live_server import TEST_SECRET, free_port

from gateway.settings import Settings
from gateway.tenancy.admin_auth import mint_admin_token

MODEL = "demo"
# Engines that take the demo model's whole context: a stream long enough to hang up on.
LONG = ("--no-cpu-kernels", "--max-model-len", "2048")


@dataclass
class Front:
    """A gateway (`url`, a tenant's `key`) whose model's one url is nginx at `picker_url`."""

    url: str
    picker_url: str
    key: str
    access_log: Path
    engines: list[EngineService]
    gateway_log: Path
    adapter: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def picked(self) -> list[dict[str, Any]]:
        """nginx's access log: each request it passed on, its body, where it sent it."""
        lines = self.access_log.read_text().splitlines() if self.access_log.exists() else []
        return [json.loads(line) for line in lines]

    def metric(self, name: str) -> float:
        return metric_sum(httpx.get(f"{self.url}/metrics", timeout=10).text, name)


def _nginx_conf(root: Path, port: int, upstreams: list[int]) -> Path:
    """nginx balancing over `upstreams` per request; each body logged as JSON."""
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"):
        (root / kind).mkdir(parents=True, exist_ok=True)
    servers = "".join(f"    server 127.0.0.1:{p};\n" for p in upstreams)
    temp = "".join(f"  {k}_temp_path {root / k};\n" for k in ("client_body", "proxy"))
    temp += "".join(f"  {k}_temp_path {root / k};\n" for k in ("fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = root / "nginx.conf"
    conf.write_text(
        f"""{user}daemon off;
worker_processes 1;
pid {root / "nginx.pid"};
error_log {root / "logs" / "error.log"};
events {{ worker_connections 256; }}
http {{
{temp}  log_format picked escape=json
    '{{"uri":"$request_uri","upstream":"$upstream_addr","status":"$status","body":"$request_body"}}';
  access_log {root / "logs" / "access.log"} picked;
  upstream engines {{
{servers}    keepalive 8;
  }}
  server {{
    listen 127.0.0.1:{port};
    client_body_buffer_size 1m;  # the body stays in memory, so $request_body has it
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""
    )
    return conf


@contextmanager
def _nginx(nginx: str, root: Path, upstreams: list[int]) -> Iterator[str]:
    port = free_port()
    conf = _nginx_conf(root, port, upstreams)
    proc = subprocess.Popen(
        [nginx, "-p", str(root), "-e", str(root / "logs" / "error.log"), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (root / "logs" / "error.log").read_text()
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def _gateway(root: Path, models_file: Path, *flags: str) -> Iterator[tuple[str, Path]]:
    """`loragate serve` of the models file on a fresh SQLite database, until the block ends."""
    port = free_port()
    log = root / "serve.log"
    command = [LORAGATE_CLI, "serve", "--models-config", str(models_file), "--port", str(port)]
    command += ["--engine-token", TOKEN, "--no-demo-tenant", "--spare-engines", "0"]
    command += ["--database-url", f"sqlite+aiosqlite:///{root / 'loragate.db'}"]
    command += ["--adapter-store", str(root / "adapters"), *flags]
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=root,
            env=os.environ | {"LORAGATE_SECRET_KEY": TEST_SECRET, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url, log
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)


def _stop(engine: EngineService) -> None:
    if engine.process.poll() is None:
        os.killpg(engine.process.pid, signal.SIGTERM)
        engine.process.wait(30)


def _models_file(root: Path, model_dir: Path, url: str, min_replicas: int = 1) -> Path:
    path = root / "models.yaml"
    path.write_text(
        f"models:\n  - name: {MODEL}\n    path: {model_dir}\n    urls: [{url}]\n"
        f"    routing: picker\n    min_replicas: {min_replicas}\n"
        "    engine: {max_model_len: 2048}\n"
    )
    return path


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {mint_admin_token(Settings(secret_key=TEST_SECRET), 600)}"}


def _tenant(url: str) -> str:
    """A tenant made through the admin REST; its key."""
    with httpx.Client(base_url=url, headers=_admin(), timeout=60) as client:
        tenant = client.post("/admin/tenants", json={"name": "picked"})
        assert tenant.status_code == 201, tenant.text
        key = client.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={})
        assert key.status_code == 201, key.text
        return str(key.json()["key"])


@pytest.fixture(scope="module")
def front(
    nginx: str,
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Front]:
    """Two engines behind nginx, a gateway in front with one tenant and its adapter."""
    root = tmp_path_factory.mktemp("picker")
    engines = [
        start_engine(demo_model_dir, root / "adapters", root / f"e{i}.log", *LONG) for i in (0, 1)
    ]
    try:
        for engine in engines:
            wait_healthy(engine)
        ports = [int(e.url.rsplit(":", 1)[1]) for e in engines]
        with (
            _nginx(nginx, root / "nginx", ports) as picker_url,
            _gateway(root, _models_file(root, demo_model_dir, picker_url)) as (url, log),
        ):
            access_log = root / "nginx" / "logs" / "access.log"
            front = Front(url, picker_url, _tenant(url), access_log, engines, log)
            files = demo_adapters["r8-all"]
            adapter = httpx.post(
                f"{url}/admin/adapters",
                headers=_admin(),
                data={"name": "sticky", "base_model": MODEL},
                files={
                    name: (name, (files / name).read_bytes())
                    for name in ("adapter_config.json", "adapter_model.safetensors")
                },
                timeout=60,
            )
            assert adapter.status_code == 201, adapter.text
            front.adapter = str(adapter.json()["id"])
            yield front
    finally:
        for engine in engines:
            _stop(engine)


def _complete(front: Front, **body: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0} | body
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(f"{front.url}{path}", json=body, headers=front.auth, timeout=120)


def _generated(front: Front) -> list[dict[str, Any]]:
    return [p for p in front.picked() if p["uri"] == "/internal/v1/generate"]


def test_each_request_is_picked_on_its_own_and_answers_as_an_engine(front: Front) -> None:
    before = len(_generated(front))
    prompt = "The quick brown fox"
    answers = [_complete(front, prompt=prompt) for _ in range(4)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    texts = {a.json()["choices"][0]["text"] for a in answers}
    assert len(texts) == 1  # greedy, one model: whichever engine took it
    # The same prompt straight to an engine's own OpenAI route answers the same.
    direct = httpx.post(
        f"{front.engines[0].url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert direct.json()["choices"][0]["text"] in texts
    usage = answers[0].json()["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 0
    picked = _generated(front)[before:]
    assert len(picked) == 4
    assert {p["status"] for p in picked} == {"200"}
    # nginx chose per request: both engines took some (one pinned link would give one).
    assert len({p["upstream"] for p in picked}) == 2
    for p in picked:
        body = json.loads(p["body"])
        assert body["model"] == MODEL
        assert body["prompt"].endswith(prompt)  # the text the picker's prefix scorer hashes
        assert json.loads(body["loragate"])["cache_salt"]  # the tenant's salt rides along


def test_a_bad_grammar_is_a_400_from_the_engine_that_took_it(front: Front) -> None:
    """The gateway asks nothing ahead (the picker chooses the engine as the request is sent):
    that engine compiles the grammar first and refuses it before anything streams."""
    for stream in (False, True):
        bad = _complete(front, prompt="x", guided_regex="a(b", stream=stream)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "guided_regex"
        assert "cannot compile the regex" in bad.json()["error"]["message"]
    good = _complete(front, prompt="x", guided_choice=["left", "right"])
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] in ("left", "right")


def test_an_adapters_stream_is_named_by_its_id_for_the_picker(front: Front) -> None:
    before = len(_generated(front))
    chunks, done = [], False
    body = {"model": "sticky", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{front.url}/v1/chat/completions", json=body, headers=front.auth, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done and len(chunks) >= 3  # streamed token by token through both hops
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    (picked,) = _generated(front)[before:]
    assert json.loads(picked["body"])["model"] == front.adapter  # running_lora_adapters' name


def test_a_client_that_hangs_up_frees_its_sequence_on_the_engine(front: Front) -> None:
    body = {"model": MODEL, "prompt": "count", "max_tokens": 2000, "temperature": 0}
    with httpx.stream(
        "POST",
        f"{front.url}/v1/completions",
        json=body | {"stream": True, "ignore_eos": True},
        headers=front.auth,
        timeout=120,
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)  # a few tokens in (the stream open: reading on would go on)
        busy = sum(e.metric("loragate:num_requests_running") for e in front.engines)
        assert busy == 1
    # Far sooner than the 2,000 tokens it asked for would take.
    deadline = time.monotonic() + 3
    while sum(e.metric("loragate:num_requests_running") for e in front.engines):
        assert time.monotonic() < deadline, "the engine still runs the abandoned request"
        time.sleep(0.1)


def test_no_engine_up_holds_the_request_until_one_is(
    nginx: str, demo_model_dir: Path, tmp_path: Path
) -> None:
    """The pool at zero: nginx answers 502 until the engine listens on its port."""
    port = free_port()
    with (
        _nginx(nginx, tmp_path / "nginx", [port]) as picker_url,
        _gateway(
            tmp_path,
            _models_file(tmp_path, demo_model_dir, picker_url, min_replicas=0),
            "--max-pending-per-model",
            "1",
            "--cold-start-timeout",
            "120",
        ) as (url, _),
    ):
        key = _tenant(url)
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # at zero by design
        results: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
        held = threading.Thread(
            target=lambda: results.append(
                httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=180)
            )
        )
        held.start()
        deadline = time.monotonic() + 30
        while metric_sum(httpx.get(f"{url}/metrics").text, "loragate:model_pending_requests") < 1:
            assert time.monotonic() < deadline, "the request was not held"
            time.sleep(0.1)
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_sum(metrics, "loragate:engine_replicas") == 0
        over = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert over.status_code == 503, over.text
        assert over.headers["Retry-After"]
        assert "requests wait for one" in over.json()["error"]["message"]
        assert held.is_alive()
        engine = start_engine(
            demo_model_dir, tmp_path / "adapters", tmp_path / "e.log", *LONG, port=port
        )
        try:
            held.join(180)
            assert not held.is_alive()
            (answer,) = results
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 3
            metrics = httpx.get(f"{url}/metrics").text
            assert metric_sum(metrics, "loragate:model_pending_requests") == 0
            assert metric_sum(metrics, "loragate:engine_replicas") == 1
        finally:
            _stop(engine)
