"""`loragate engine --engine-process`: the engine process is forked from the host's zygote,
and when it is SIGKILLed the host forks the next one from there and answers as before."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from engine_services import start_engine, wait_healthy
from process_tree import engine_processes


def _complete(url: str) -> str:
    body = {"model": "demo", "prompt": "one two three", "max_tokens": 6, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def _wait_for(log: Path, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.1)


def test_a_killed_engine_process_is_forked_again_from_the_zygote(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the log's lines unwrapped
    log = tmp_path / "engine.log"
    engine = start_engine(demo_model_dir, tmp_path / "adapters", log, "--engine-process")
    try:
        wait_healthy(engine)
        before = _complete(engine.url)
        (first,) = engine_processes(engine.process.pid)
        os.kill(first, signal.SIGKILL)
        _wait_for(log, "the engine process is back, started in a fork of the zygote")
        (second,) = engine_processes(engine.process.pid)
        assert second != first
        assert _complete(engine.url) == before
    finally:
        os.killpg(engine.process.pid, signal.SIGTERM)
        engine.process.wait(timeout=60)
