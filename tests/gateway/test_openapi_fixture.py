"""The served OpenAPI document is the one committed in tests/data/openapi.json: moving modules
(the gateway's regrouping) must not change what clients see. A change meant to alter the API
regenerates it (LORAGATE_WRITE_OPENAPI=1) and shows the difference in its commit."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from live_server import build_test_app, lora_engine

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "openapi.json"


def _served_document(demo_model_dir: Path, tmp_path: Path) -> str:
    engine = lora_engine(demo_model_dir, 16 << 20, max_model_len=64)
    try:
        app = build_test_app(
            engine, "demo", tmp_path, demo_model_dir, allow_runtime_lora_updating=True
        )
        return json.dumps(app.openapi(), indent=1, sort_keys=True) + "\n"
    finally:
        asyncio.run(engine.shutdown(0))


def test_the_openapi_document_is_the_committed_one(demo_model_dir: Path, tmp_path: Path) -> None:
    served = _served_document(demo_model_dir, tmp_path)
    if os.environ.get("LORAGATE_WRITE_OPENAPI") == "1":
        FIXTURE.write_text(served)
        pytest.skip(f"wrote {FIXTURE}")
    assert served == FIXTURE.read_text(), (
        "the OpenAPI document changed; if meant, regenerate it with LORAGATE_WRITE_OPENAPI=1"
    )
