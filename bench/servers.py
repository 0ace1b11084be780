"""Servers a benchmark starts and stops: one command line each, in a process group of its own
(its engine processes go with it), its output in a log file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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
    url: str, proc: subprocess.Popen[bytes], log: Path, path: str = "/v1/models"
) -> None:
    """Until GET url+path answers 200; raises if the server exits or takes too long."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S:.0f} s; log: {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group, SIGKILL after a minute."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
