"""The schema and the routes agree, as schemathesis's own CLI sees it with `--checks all`:
one pass with a tenant's key over /v1, one with an admin token over /admin, against a live
server. The only checks relaxed are the 400s tests/gateway/schemathesis.toml names, one
operation at a time (test_openapi.py checks those 400s' codes in-process)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import Server, build_test_app, live_server, lora_engine

CONFIG = Path(__file__).with_name("schemathesis.toml")
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")  # valid responses reach the model
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
PASSES = {
    "tenant": (
        r"^/(v1/(batches|chat|completions|conversations|files|models|responses|usage)|health|metrics)"
    ),
    "admin": r"^/(admin|v1/organization|v1/load_lora_adapter|v1/unload_lora_adapter)",
}


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A short context bounds the work any generated request may ask for.
    engine = lora_engine(demo_model_dir, 32 << 20, max_model_len=64, max_waiting=512)
    app = build_test_app(
        engine,
        "demo",
        tmp_path_factory.mktemp("tenancy"),
        demo_model_dir,
        settings={"max_adapter_bytes": 1 << 20},
        allow_runtime_lora_updating=True,
    )
    with live_server(app, engine) as live:
        yield live


@pytest.mark.parametrize("credentials", PASSES)
def test_schemathesis_finds_no_disagreement(server: Server, credentials: str) -> None:
    headers = server.admin_headers if credentials == "admin" else server.headers
    command = [
        str(SCHEMATHESIS),
        "--config-file",
        str(CONFIG),
        "run",
        f"{server.base_url}/openapi.json",
        "--checks",
        "all",
        "--include-path-regex",
        PASSES[credentials],
        "--max-examples",
        "30",
        "--generation-deterministic",
        "--no-color",
        "--header",
        f"Authorization: {headers['Authorization']}",
    ]
    env = os.environ | {"SCHEMATHESIS_HOOKS": str(HOOKS)}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    assert " passed" in report and "Tested: " in report, report[-2000:]
