"""deploy/nginx/loragate.conf as shipped, in front of a real `loragate serve`: `nginx -t`
accepts it, its body limits are the gateway's defaults, and over HTTPS through it a streamed
completion arrives token by token, request ids come back and get logged, and a body past
the gateway's limit is refused by nginx (413) while one at the limit reaches the gateway.

The file is used as it is, with only its documented placeholders (upstream address, ports,
certificate paths, log directory) replaced, inside a minimal nginx.conf of the test's own
(its own prefix, pid file and temporary directories, in the foreground)."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from bench.servers import LORAGATE_CLI, spawn, stop, wait_ready
from gateway.settings import Settings

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "loragate.conf"
NGINX_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


@dataclass(frozen=True)
class Stack:
    """nginx on `https_url` in front of a gateway on `gateway_url`, with a tenant's key."""

    https_url: str
    gateway_url: str
    api_key: str
    tls: ssl.SSLContext
    access_log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.https_url,
            verify=self.tls,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=120,
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def nginx_sizes(text: str) -> list[int]:
    """Every client_max_body_size of a config, in bytes, in the order they appear."""
    sizes = re.findall(r"^\s*client_max_body_size\s+(\d+)([kmg]?)\s*;", text, re.M | re.I)
    return [int(n) * NGINX_UNITS[unit.lower()] for n, unit in sizes]


def render(text: str, values: dict[str, str]) -> str:
    """The shipped config with its placeholders replaced; each must be there, or the file
    changed under this test."""
    for placeholder, value in values.items():
        assert placeholder in text, f"{SHIPPED.name} no longer has {placeholder!r}"
        text = text.replace(placeholder, value)
    return text


def write_nginx_conf(root: Path, gateway_port: int, https_port: int, http_port: int) -> Path:
    """A self-signed certificate, the shipped file rendered for this machine, and a main
    nginx.conf including it; returns the main file."""
    tls = root / "tls"
    tls.mkdir()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(tls / "key.pem"), "-out", str(tls / "cert.pem")]
        + ["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    logs = root / "logs"
    logs.mkdir()
    site = render(
        SHIPPED.read_text(),
        {
            "server 127.0.0.1:8000;": f"server 127.0.0.1:{gateway_port};",
            "listen 443 ssl;": f"listen 127.0.0.1:{https_port} ssl;",
            "listen [::]:443 ssl;\n": "",  # the test machine may have no IPv6
            "listen 80;": f"listen 127.0.0.1:{http_port};",
            "listen [::]:80;\n": "",
            "/etc/nginx/tls/loragate.crt": str(tls / "cert.pem"),
            "/etc/nginx/tls/loragate.key": str(tls / "key.pem"),
            "/var/log/nginx/": f"{logs}/",
        },
    )
    (root / "loragate.conf").write_text(site)
    temp = "\n".join(
        f"    {kind}_temp_path {root / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # As root, workers run as root too: the test's directories are not world-readable.
    user = "user root;\n" if os.geteuid() == 0 else ""
    main = root / "nginx.conf"
    main.write_text(
        f"""{user}daemon off;
worker_processes 1;
pid {root / "nginx.pid"};
error_log {logs / "error.log"} info;
events {{ worker_connections 256; }}
http {{
{temp}
    include {root / "loragate.conf"};
}}
"""
    )
    return main


def nginx_command(nginx: str, conf: Path, *args: str) -> list[str]:
    return [nginx, "-p", str(conf.parent), "-e", str(conf.parent / "logs" / "error.log")] + [
        "-c",
        str(conf),
        *args,
    ]


@pytest.fixture(scope="module")
def stack(
    nginx: str, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """`loragate serve` on the demo model (a fresh SQLite database: it creates tenant `demo`
    and prints its key) and nginx in front of it."""
    root = tmp_path_factory.mktemp("nginx")
    gateway_port, https_port = free_port(), free_port()
    conf = write_nginx_conf(root, gateway_port, https_port, free_port())
    serve_log = root / "serve.log"
    gateway = spawn(
        [LORAGATE_CLI, "serve", "--model", str(demo_model_dir), "--served-model-name", "demo"]
        + ["--port", str(gateway_port), "--spare-engines", "0"]
        + ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]
        + ["--database-url", f"sqlite+aiosqlite:///{root / 'loragate.db'}"]
        + ["--adapter-store", str(root / "adapters")],
        serve_log,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "400"},
    )
    proxy = None
    try:
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        wait_ready(gateway_url, gateway, serve_log, path="/health")
        key = re.search(r"export LORAGATE_API_KEY=(lg-\S+)", serve_log.read_text())
        assert key is not None, serve_log.read_text()
        proxy = subprocess.Popen(
            nginx_command(nginx, conf),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        tls = ssl.create_default_context(cafile=str(root / "tls" / "cert.pem"))
        https_url = f"https://127.0.0.1:{https_port}"
        _wait_nginx(https_url, tls, proxy, root)
        yield Stack(
            https_url, gateway_url, key.group(1), tls, root / "logs" / "loragate.access.log"
        )
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        stop(gateway)


def _wait_nginx(url: str, tls: ssl.SSLContext, proc: subprocess.Popen[bytes], root: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "logs" / "error.log").read_text()
        try:
            if httpx.get(f"{url}/health", verify=tls, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("nginx did not answer /health")


def test_body_limits_are_the_gateways_defaults() -> None:
    """client_max_body_size: the server's (max_body_bytes), then adapter uploads' own."""
    defaults = Settings.model_fields
    assert nginx_sizes(SHIPPED.read_text()) == [
        defaults["max_body_bytes"].default,
        defaults["max_adapter_bytes"].default,
    ]


def test_the_directives_streaming_needs_are_there() -> None:
    text = SHIPPED.read_text()
    for directive in (
        "proxy_buffering off;",
        "proxy_http_version 1.1;",
        "proxy_set_header Upgrade $http_upgrade;",
        "proxy_set_header Connection $loragate_connection;",
        "proxy_set_header X-Request-ID $loragate_request_id;",
    ):
        assert directive in text
    assert re.search(r"^\s*keepalive \d+;", text, re.M)
    timeout = re.search(r"^\s*proxy_read_timeout (\d+)s;", text, re.M)
    assert timeout is not None and int(timeout.group(1)) >= 3600


def test_nginx_accepts_the_shipped_config(nginx: str, tmp_path: Path) -> None:
    conf = write_nginx_conf(tmp_path, free_port(), free_port(), free_port())
    done = subprocess.run(nginx_command(nginx, conf, "-t"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "syntax is ok" in done.stderr


def test_a_streamed_completion_arrives_token_by_token(stack: Stack) -> None:
    """Through nginx the events come in many reads, as the tokens are made, the first one
    long before [DONE], not in a few reads of whole buffers at the end. (proxy_buffering off
    and the gateway's X-Accel-Buffering: no both ask for it: either alone passes.) A gateway
    that falls behind merges the deltas queued for one sequence, so the events may be fewer
    than the tokens; their text is the whole answer all the same."""
    body = {
        "model": "demo",
        "prompt": "Hello",
        "max_tokens": 64,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    reads: list[bytes] = []
    with stack.client() as client, client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        reads.extend(chunk for chunk in resp.iter_raw() if chunk)
    events = [e for e in b"".join(reads).split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    with stack.client() as client:
        whole = client.post("/v1/completions", json=body | {"stream": False})
    assert streamed == whole.json()["choices"][0]["text"]
    first = next(i for i, r in enumerate(reads) if b"data: {" in r)
    done = next(i for i, r in enumerate(reads) if b"data: [DONE]" in r)
    assert first < done
    # Reads that carried an event: a buffering proxy gives a handful for 64 tokens.
    assert sum(b"data: " in r for r in reads) >= 16, [len(r) for r in reads]


def test_the_websocket_mode_passes_through(stack: Stack) -> None:
    """The Responses API's WebSocket mode through nginx: upgraded, answered to the end."""
    url = stack.https_url.replace("https://", "wss://") + "/v1/responses"
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    create = {"type": "response.create", "model": "demo", "input": "Hi", "max_output_tokens": 4}
    with connect(url, additional_headers=headers, ssl=stack.tls, open_timeout=30) as ws:
        for _ in range(2):  # two responses on the one socket
            ws.send(json.dumps(create))
            kinds = []
            while not kinds or kinds[-1] not in ("response.completed", "response.incomplete"):
                kinds.append(json.loads(ws.recv(timeout=60))["type"])
            assert kinds[0] == "response.created"


def test_request_ids_come_back_and_are_logged(stack: Stack) -> None:
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    with stack.client() as client:
        given = client.post("/v1/completions", json=body, headers={"X-Request-ID": "client-1"})
        made_up = client.post("/v1/completions", json=body)
    for resp in (given, made_up):
        assert resp.status_code == 200, resp.text
        assert re.fullmatch(r"req_[0-9a-f]{32}", resp.headers["x-request-id"])
    _wait_for_line(stack.access_log, f"id=client-1 gateway_id={given.headers['x-request-id']}")
    # Without one, nginx's $request_id (32 hex digits) is sent on and logged.
    _wait_for_line(
        stack.access_log, rf"id=[0-9a-f]{{32}} gateway_id={made_up.headers['x-request-id']}"
    )


def test_a_body_past_the_limit_is_refused_by_nginx(stack: Stack) -> None:
    limit = Settings.model_fields["max_body_bytes"].default
    headers = {"Content-Type": "application/json"}
    with stack.client() as client:
        over = client.post("/v1/completions", content=_body_of(limit + 1), headers=headers)
        at = client.post("/v1/completions", content=_body_of(limit), headers=headers)
    assert over.status_code == 413
    assert "nginx" in over.text and "x-request-id" not in over.headers  # not the gateway's
    # At the limit nginx lets it through: the gateway answers (its prompt is too long).
    assert at.status_code == 400, at.text
    assert "x-request-id" in at.headers


def _body_of(size: int) -> bytes:
    head, tail = b'{"model": "demo", "max_tokens": 1, "prompt": "', b'"}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def _wait_for_line(path: Path, pattern: str) -> None:
    """nginx writes a request's access line after answering it: a moment later."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text() if path.exists() else ""):
            return
        time.sleep(0.05)
    raise AssertionError(f"no line of {path} matches {pattern!r}: {path.read_text()}")
