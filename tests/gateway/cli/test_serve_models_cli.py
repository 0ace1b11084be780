"""`loragate serve --models-config` as users run it: two base models behind one server, one
always on and one that scales to zero. The lazy one has no engine process until its first
request, one after it, and none again once idle_timeout has passed (the process exits, so
its memory goes back to the machine); a bad models file stops the server with one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from live_server import free_port
from process_tree import engine_processes, zygote_pids

LORAGATE_CLI = str(Path(sys.executable).parent / "loragate")


def _serve(command: list[str], log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """`loragate serve` in a process group of its own, its output (unwrapped) in `log_path`."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1", "COLUMNS": "400"},
            cwd=cwd,
        )


def _wait(condition: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _models_file(tmp_path: Path, demo_model_dir: Path) -> Path:
    engine = "{kv_cache_memory: 64MiB, max_model_len: 256}"
    path = tmp_path / "models.yaml"
    path.write_text(
        f"""models:
  - name: always
    path: {demo_model_dir}
    engine: {engine}
  - name: lazy
    path: {demo_model_dir}
    min_replicas: 0
    idle_timeout: 2
    engine: {engine}
"""
    )
    return path


def test_a_model_that_scales_to_zero_has_an_engine_process_only_while_called(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [
        LORAGATE_CLI,
        "serve",
        "--models-config",
        str(_models_file(tmp_path, demo_model_dir)),
        "--port",
        str(port),
        "--spare-engines",  # counted below as engines are: test_a_cold_start_takes_a_warm_spare
        "0",
    ]
    server = _serve(command, log_path, tmp_path)
    try:
        _wait(lambda: b"serving" in log_path.read_bytes(), "the server")
        _wait(lambda: _get(f"{url}/health") == 200, "/health")
        key = re.search(r"export LORAGATE_API_KEY=(lg-\S+)", log_path.read_text())
        assert key is not None, log_path.read_text()
        auth = {"Authorization": f"Bearer {key.group(1)}"}
        assert len(engine_processes(server.pid)) == 1  # the always-on model's alone
        models = httpx.get(f"{url}/v1/models", headers=auth).json()["data"]
        assert {m["id"] for m in models} == {"always", "lazy"}

        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        answers = {}
        for name in ("always", "lazy"):
            resp = httpx.post(
                f"{url}/v1/completions", json=body | {"model": name}, headers=auth, timeout=120
            )
            assert resp.status_code == 200, resp.text
            answers[name] = resp.json()["choices"][0]["text"]
        assert answers["lazy"] == answers["always"]  # the same weights
        assert len(engine_processes(server.pid)) == 2
        metrics = httpx.get(f"{url}/metrics").text
        assert 'loragate:engine_cold_starts_total{model="lazy"} 1.0' in metrics

        _wait(lambda: len(engine_processes(server.pid)) == 1, "the idle engine to exit", 30)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'loragate:engine_replicas{model="lazy"} 0.0' in metrics
        assert 'loragate:engine_replicas{model="always"} 1.0' in metrics
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_a_bad_models_file_stops_the_server_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: a, path: /nonexistent}\n")
    done = subprocess.run(
        [LORAGATE_CLI, "serve", "--models-config", str(path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=os.environ | {"COLUMNS": "400"},
    )
    assert done.returncode != 0
    assert "models[0].path: /nonexistent is not a Hugging Face model directory" in done.stderr


def test_a_second_local_replica_starts_under_a_lasting_queue_and_stops_when_idle(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """max_replicas 2: one engine while nothing waits; a second starts, forked from the zygote,
    once requests have waited beyond the first's max_num_seqs for scale_up_window, takes new
    requests, and stops again after idle_timeout."""
    path = tmp_path / "models.yaml"
    path.write_text(
        f"""models:
  - name: demo
    path: {demo_model_dir}
    min_replicas: 1
    max_replicas: 2
    idle_timeout: 2
    scale_up_waiting: 2
    scale_up_window: 0.2
    engine: {{kv_cache_memory: 64MiB, max_model_len: 256, max_num_seqs: 2}}
"""
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [LORAGATE_CLI, "serve", "--models-config", str(path), "--port", str(port)]
    command += ["--spare-engines", "0"]
    server = _serve(command + ["--no-auth"], log_path, tmp_path)
    try:
        _wait(lambda: _get(f"{url}/health") == 200, "/health")
        assert len(engine_processes(server.pid)) == 1
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 200, "temperature": 0}
        body |= {"ignore_eos": True}

        def ask(_: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            first = list(pool.map(ask, range(6)))  # 2 run, 4 wait: the second replica starts
            started = "engine for 'demo/1' ready" in log_path.read_text()
            later = list(pool.map(ask, range(2)))
        answers = first + later
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1  # same weights
        log = log_path.read_text()
        assert "waited beyond its replicas" in log and "starting demo/1" in log, log
        assert re.search(r"engine for 'demo/1' ready in [\d.]+ s, in a fork of the zygote", log)
        assert started  # while the first six were served
        metrics = httpx.get(f"{url}/metrics").text
        # 1 + the second's starts: once, or again if it idled out between the two batches (a
        # slow machine serves the first six for longer than the 2 s idle timeout).
        starts = 1 + log_path.read_text().count("starting demo/1")
        assert f'loragate:engine_cold_starts_total{{model="demo"}} {starts}.0' in metrics
        _wait(lambda: len(engine_processes(server.pid)) == 1, "the idle replica to stop", 30)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'loragate:engine_replicas{model="demo"} 1.0' in metrics
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def test_a_cold_start_takes_a_warm_spare(demo_model_dir: Path, tmp_path: Path) -> None:
    """With --spare-engines 1 a process with torch imported waits before any request; the
    first request to a model scaled to zero runs its engine in that process (no new one is
    spawned for it), and the spare's place is taken by another one later."""
    path = tmp_path / "models.yaml"
    path.write_text(
        f"""models:
  - name: lazy
    path: {demo_model_dir}
    min_replicas: 0
    engine: {{kv_cache_memory: 64MiB, max_model_len: 256}}
"""
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [LORAGATE_CLI, "serve", "--models-config", str(path), "--port", str(port)]
    server = _serve(command + ["--no-auth", "--spare-engines", "1"], log_path, tmp_path)
    ready = re.compile(r"a spare engine process \(pid (\d+)\) is ready")
    try:
        _wait(lambda: ready.search(log_path.read_text()), "a ready spare", 120)
        match = ready.search(log_path.read_text())
        assert match is not None
        spare = int(match.group(1))
        assert engine_processes(server.pid) == [spare]  # the spare alone: no engine yet
        body = {"model": "lazy", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        # The engine runs in the spare (a new spare starts only seconds after the take).
        assert engine_processes(server.pid) == [spare]
        _wait(lambda: len(ready.findall(log_path.read_text())) == 2, "the next spare", 120)
        assert len(engine_processes(server.pid)) == 2
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def _lazy_models_file(tmp_path: Path, demo_model_dir: Path, names: list[str]) -> Path:
    engine = "{kv_cache_memory: 32MiB, max_model_len: 256}"
    entries = "".join(
        f"  - {{name: {name}, path: {demo_model_dir}, min_replicas: 0, engine: {engine}}}\n"
        for name in names
    )
    path = tmp_path / "models.yaml"
    path.write_text("models:\n" + entries)
    return path


def test_cold_starts_fork_from_the_zygote_which_survives_a_kill(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """Four models at zero woken at once are all answered, each engine forked from the zygote
    (the log says so); the zygote killed with SIGKILL is started again, the engines it forked
    keep serving, and the next cold start is served."""
    names = ["m0", "m1", "m2", "m3"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [LORAGATE_CLI, "serve", "--port", str(port), "--no-auth", "--spare-engines", "0"]
    command += ["--models-config", str(_lazy_models_file(tmp_path, demo_model_dir, names))]
    server = _serve(command, log_path, tmp_path)
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}

    def ask(name: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json=body | {"model": name}, timeout=120)

    try:
        _wait(lambda: _get(f"{url}/health") == 200, "/health")
        assert engine_processes(server.pid) == []  # no model's engine before its request
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, names[:3]))
        assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
        forked = re.findall(
            r"engine for '(m\d)' ready in [\d.]+ s, in a fork of the zygote", _log(log_path)
        )
        assert sorted(forked) == names[:3], _log(log_path)
        assert len(engine_processes(server.pid)) == 3

        (zygote,) = zygote_pids(server.pid)
        os.kill(zygote, signal.SIGKILL)
        _wait(lambda: zygote_pids(server.pid) not in ([], [zygote]), "a new zygote", 120)
        assert ask("m0").status_code == 200  # forked from the dead one, still serving
        resp = ask("m3")  # a cold start from the new zygote
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == answers[0].json()["choices"][0]["text"]
        assert "'m3' ready" in _log(log_path) and "in a fork of the zygote" in _log(log_path)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def test_a_model_that_fails_to_start_is_a_503_and_leaves_the_zygote_alive(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """A model whose weights are gone by its first request: that request gets the 503 with
    Retry-After, the zygote lives on, and another model still starts from it."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in demo_model_dir.iterdir():
        (broken / item.name).symlink_to(item)
    path = _lazy_models_file(tmp_path, demo_model_dir, ["good"])
    path.write_text(
        path.read_text()
        + f"  - {{name: broken, path: {broken}, min_replicas: 0, engine: {{max_model_len: 256}}}}\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [LORAGATE_CLI, "serve", "--port", str(port), "--no-auth", "--spare-engines", "0"]
    server = _serve(command + ["--models-config", str(path)], log_path, tmp_path)
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    try:
        _wait(lambda: _get(f"{url}/health") == 200, "/health")
        for weights in broken.glob("*.safetensors"):
            weights.unlink()  # the directory checked at start-up, its weights gone since
        resp = httpx.post(f"{url}/v1/completions", json=body | {"model": "broken"}, timeout=120)
        assert resp.status_code == 503, resp.text
        assert resp.headers.get("retry-after")
        assert resp.json()["error"]["message"]
        (zygote,) = zygote_pids(server.pid)
        resp = httpx.post(f"{url}/v1/completions", json=body | {"model": "good"}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert zygote_pids(server.pid) == [zygote]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def _log(path: Path) -> str:
    return path.read_text(errors="replace")
