"""Speculative decoding behind the OpenAI server: a step that appends several tokens to a
choice streams them as the same text the unstreamed answer has, usage counts every token,
and /metrics reports the drafts (SmolLM2 copying from its prompt accepts most of them)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from live_server import build_test_app, live_server

from engine import EngineConfig, LLMEngine
from engine.frontend.async_engine import AsyncEngine
from engine.spec_decode import SpeculativeConfig

pytestmark = pytest.mark.smollm2

DOCUMENT = (
    "Order 7731: 4 x blue ceramic mug (SKU MUG-BL-04) at 12.50; 1 x teapot (SKU TP-220) at "
    "38.00; shipping to 5 Elm Row, Edinburgh EH7 4AA."
)


def _counter(text: str, name: str) -> float:
    match = re.search(rf'^{name}_total{{model_name="smollm2"}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_streamed_and_whole_answers_agree_with_drafts_accepted(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    config = EngineConfig(
        model=str(smollm2_dir),
        kv_cache_memory=128 << 20,
        max_model_len=1024,
        dtype="float32",
        speculative_config=SpeculativeConfig(num_speculative_tokens=4),
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=16)
    engine.start()
    with live_server(build_test_app(engine, "smollm2", tmp_path, smollm2_dir), engine) as server:
        client = server.client()
        messages = [{"role": "user", "content": f"Repeat this order exactly:\n\n{DOCUMENT}"}]
        whole = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=64, temperature=0
        )
        chunks = list(
            client.chat.completions.create(
                model="smollm2",
                messages=messages,
                max_tokens=64,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        metrics = httpx.get(f"{server.base_url}/metrics").text
    drafted = _counter(metrics, "loragate:spec_decode_num_draft_tokens")
    accepted = _counter(metrics, "loragate:spec_decode_num_accepted_tokens")
    assert _counter(metrics, "loragate:spec_decode_num_drafts") > 0
    assert 0 < accepted <= drafted and accepted > drafted / 2
