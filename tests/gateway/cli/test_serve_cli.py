"""`loragate serve` as users run it, in a process group of its own: an engine process that
dies is an error, its requests end with 503 and it comes back (--restart-engine); a SIGTERM
to the whole group (a container stop, Ctrl-C) is an orderly shutdown, logged as such."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from live_server import free_port
from process_tree import engine_processes

from bench.servers import wait_ready

MODEL = "demo"


def _engine_pid(server_pid: int) -> int:
    """The engine process: forked by the server's zygote, or spawned by the server."""
    engines = engine_processes(server_pid)
    assert len(engines) == 1, f"engine processes: {engines}"
    return engines[0]


def test_engine_death_restart_and_orderly_shutdown(demo_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [
        str(Path(sys.executable).parent / "loragate"),
        "serve",
        "--model",
        str(demo_model_dir),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "256",
    ]
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1", "COLUMNS": "400"},  # no wrapped lines
            cwd=tmp_path,  # the database, its secret and the adapter store go here
        )
    try:
        wait_ready(url, server, log_path, "/health", timeout=120)
        # On an empty database the server made tenant `demo` and printed its key once.
        key = re.search(r"export LORAGATE_API_KEY=(lg-\S+)", log_path.read_text())
        assert key is not None, log_path.read_text()
        auth = {"Authorization": f"Bearer {key.group(1)}"}
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
        assert resp.status_code == 200

        # The operators' commands act on the server's database and sign tokens it accepts.
        def loragate(*args: str) -> str:
            done = subprocess.run(
                [command[0], *args], cwd=tmp_path, capture_output=True, text=True, check=True
            )
            return done.stdout.strip()

        token = loragate("admin", "token", "--ttl", "10m")
        admin = {"Authorization": f"Bearer {token}"}
        tenants = httpx.get(f"{url}/admin/tenants", headers=admin)
        assert tenants.status_code == 200 and tenants.json()["data"][0]["name"] == "demo"
        loragate("tenants", "create", "cli-made", "--rpm-limit", "30", "--allowed-model", MODEL)
        assert "cli-made" in loragate("tenants", "list")
        made = httpx.get(f"{url}/admin/tenants", headers=admin).json()["data"][-1]
        assert made["name"] == "cli-made" and made["rpm_limit"] == 30
        assert made["allowed_models"] == [MODEL]
        cli_key = {"Authorization": f"Bearer {loragate('keys', 'create', 'cli-made')}"}
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=cli_key, timeout=60)
        assert resp.status_code == 200

        # The engine dies under a running request: the request ends with a 503-type error.
        events: list[dict] = []
        first = threading.Event()

        def stream() -> None:
            long = body | {"max_tokens": 240, "ignore_eos": True, "stream": True}
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=long, headers=auth, timeout=60
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        os.kill(_engine_pid(server.pid), signal.SIGKILL)
        reader.join(60)
        assert events[-1]["error"]["type"] == "service_unavailable", events[-1]
        resp = httpx.get(f"{url}/health")
        assert resp.status_code == 503 or resp.json() == {"status": "ok"}
        # the supervisor started a new engine process
        wait_ready(url, server, log_path, "/health", timeout=120)
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
        assert resp.status_code == 200

        before_stop = log_path.read_text()
        os.killpg(server.pid, signal.SIGTERM)  # the whole group, engine process included
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit -15).
        assert server.wait(60) in (0, -signal.SIGTERM)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    # Compare words: rich pads log lines.
    assert "the engine process exited unexpectedly" in " ".join(before_stop.split())
    shutdown_log = " ".join(log_path.read_text()[len(before_stop) :].split())
    assert "the engine process stopped" in shutdown_log, shutdown_log
    assert "ERROR" not in shutdown_log and "Traceback" not in shutdown_log, shutdown_log
