"""`loragate engine` processes as operators run them, for tests of gateways in front of them:
started with the engine token and an adapter store, read back through `/health` and
`/metrics`."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
from live_server import free_port

from bench.servers import wait_ready

LORAGATE_CLI = str(Path(sys.executable).parent / "loragate")
TOKEN = "an-engine-token-that-is-long-enough-for-loragate-0123456789"
ENGINE_KNOBS = ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--num-threads", "1"]


@dataclass
class EngineService:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def metric(self, name: str) -> float:
        return metric_sum(httpx.get(f"{self.url}/metrics").text, name)


def metric_sum(text: str, name: str) -> float:
    """A series' samples summed over their labels, from a Prometheus text exposition."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} not in the metrics"
    return sum(values)


def start_engine(
    model_dir: Path, store: Path, log: Path, *flags: str, port: int | None = None
) -> EngineService:
    """`loragate engine` of `model_dir` served as `demo`, in a process group of its own (on
    `port`, else a free one); `flags` go to its command line after the defaults."""
    port = port or free_port()
    command = [LORAGATE_CLI, "engine", "--model", str(model_dir), "--port", str(port)]
    command += ["--served-model-name", "demo"]
    command += ["--engine-token", TOKEN, "--adapter-store", str(store), *ENGINE_KNOBS, *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return EngineService(f"http://127.0.0.1:{port}", process, log)


def wait_healthy(engine: EngineService, timeout: float = 120.0) -> None:
    wait_ready(engine.url, engine.process, engine.log, "/health", timeout=timeout)
