"""The way one streamed chat completion with an adapter takes through the gateway, traced: the
product modules its calls enter while serving it, in the order each is first entered, are the
numbered list in docs/architecture.md ("One request's way"): a change to the way changes the
list in the same commit.

The engine's own loop runs on its thread and is not traced here: this is the gateway's side,
from the route to the engine client and back to the last SSE chunk and the usage row."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from live_server import build_test_app, lora_engine, register_public

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("gateway", "engine", "tenants", "adapters", "kernels")
DOC = ROOT / "docs" / "architecture.md"


def _module(filename: str) -> str | None:
    try:
        relative = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if relative.parts[0] not in PRODUCT or relative.suffix != ".py":
        return None
    return relative.as_posix()


async def _traced_chat(app: Any, key: str) -> list[str]:
    tenancy = app.state.server_tenancy.tenancy
    await tenancy.start()
    entered: list[str] = []

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event == "call":
            module = _module(frame.f_code.co_filename)
            if module is not None and module not in entered and _serving(frame):
                entered.append(module)

    body = {
        "model": "path-adapter",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "stream": True,
    }
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            sys.setprofile(profile)
            try:
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as resp:
                    assert resp.status_code == 200, await resp.aread()
                    chunks = [line async for line in resp.aiter_lines() if line]
            finally:
                sys.setprofile(None)
        assert chunks[-1] == "data: [DONE]"
    finally:
        await tenancy.close()
    return entered


def _serving(frame: FrameType | None) -> bool:
    """Whether a call is the request's own (under starlette's handling of it), not one of the
    background tasks that share the event loop (the ledger's writer, sweepers)."""
    while frame is not None:
        if "/starlette/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _documented() -> list[str]:
    text = DOC.read_text()
    section = text.split("### One request's way", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)


def test_a_streamed_chat_with_an_adapter_takes_the_documented_way(
    demo_model_dir: Path, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = lora_engine(demo_model_dir, 16 << 20, max_model_len=256)
    try:
        app = build_test_app(engine, "demo", tmp_path, demo_model_dir)
        register_public(app, "path-adapter", demo_adapters["r8-all"])
        entered = asyncio.run(_traced_chat(app, app.state.server_tenancy.api_key))
    finally:
        asyncio.run(engine.shutdown(0))
    print("\n".join(f"{i}. `{m}`" for i, m in enumerate(entered, 1)))
    assert entered == _documented()
