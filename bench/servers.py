"""Servers a benchmark starts and stops: one command line each, in a process group of its own
(its engine processes go with it), its output in a log file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

READY_TIMEOUT_S = 600.0
LORAGATE_CLI = str(Path(sys.executable).parent / "loragate")


def spawn(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            start_new_session=True,
        )


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    path: str = "/v1/models",
    until: Callable[[], bool] | None = None,
    timeout: float = READY_TIMEOUT_S,
) -> None:
    """Until GET url+path answers 200 (and `until()` holds, where given): the one wait for a
    server that benchmarks and tests share. Raises with the log's end if the server exits
    first or takes longer than `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); {_log_end(log)}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200 and (
                until is None or until()
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; {_log_end(log)}")


def _log_end(log: Path) -> str:
    try:
        return f"the end of {log}:\n{log.read_text(errors='replace')[-3000:]}"
    except OSError:
        return f"no log at {log}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group, SIGKILL after a minute."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
