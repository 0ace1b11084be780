"""The Conversations API on a real model (SmolLM2-135M-Instruct, its own chat template): five
turns through one conversation, greedy, and the last one answers with the name the first gave:
each turn's prompt is the conversation's items, appended turn by turn.

A 135M model recalls a name it was told only once it has said it itself (asked "What is my
name?" after "My name is Alice." it names itself, even in a conversation of two turns), so the
first turn asks it to remember the name and its answer greets Alice; no later input names her,
so the last turn can take the name only from the conversation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import Server, build_test_app, live_server

from engine.async_engine import AsyncEngine

pytestmark = pytest.mark.smollm2

TURNS = (
    "My name is Alice. Please remember it.",
    "What is 2 + 2?",
    "Name a fruit.",
    "Say hello.",
    "What is my name?",
)


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from engine import EngineConfig, LLMEngine

    config = EngineConfig(
        model=str(smollm2_dir), kv_cache_memory=128 << 20, max_model_len=2048, num_threads=2
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=16)
    engine.start()
    root = tmp_path_factory.mktemp("conversations-smollm2")
    app = build_test_app(engine, "smollm2", root, smollm2_dir)
    with live_server(app, engine) as server:
        yield server


def test_five_turns_through_a_conversation_remember_the_first(server: Server) -> None:
    client = server.client()
    conversation = client.conversations.create()
    inputs, answers = [], []
    for text in TURNS:
        response = client.responses.create(
            model="smollm2",
            input=text,
            conversation=conversation.id,
            max_output_tokens=32,
            temperature=0,
        )
        assert response.usage is not None
        inputs.append(response.usage.input_tokens)
        answers.append(response.output_text)
    # Each turn's prompt held every earlier turn: it grew each time.
    assert inputs == sorted(inputs) and len(set(inputs)) == len(TURNS)
    items = list(client.conversations.items.list(conversation.id, order="asc", limit=100))
    assert len(items) == 2 * len(TURNS)
    assert [i.role for i in items] == ["user", "assistant"] * len(TURNS)  # type: ignore[union-attr]
    assert "Alice" in answers[0], answers
    assert "Alice" in answers[-1], answers
