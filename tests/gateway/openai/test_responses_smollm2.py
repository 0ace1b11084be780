"""The Responses API on a real model (SmolLM2-135M-Instruct, its own chat template): a
conversation through `previous_response_id` whose second prompt holds the first turn and finds
it in the prefix cache, a strict json_schema answer that validates, five turns through the
Conversations API, and a compacted conversation that keeps the name it was given."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from live_server import Server, build_test_app, live_server

from engine.frontend.async_engine import AsyncEngine
from gateway.openai.responses.compaction_item import summary_of

pytestmark = pytest.mark.smollm2

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


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

    # float32: whether a 135M model recalls a name is a matter of a few logits, and bfloat16
    # rounds them differently on AMX than on AVX-512 BF16 (both are "auto" there).
    config = EngineConfig(
        model=str(smollm2_dir),
        kv_cache_memory=128 << 20,
        max_model_len=2048,
        num_threads=2,
        dtype="float32",
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=16)
    engine.start()
    root = tmp_path_factory.mktemp("responses-smollm2")
    app = build_test_app(engine, "smollm2", root, smollm2_dir)
    with live_server(app, engine) as server:
        yield server


def test_a_conversation_remembers_and_reuses_its_history(server: Server) -> None:
    client = server.client()
    first = client.responses.create(
        model="smollm2",
        input="My name is Marguerite and I live in Lyon. Say hello.",
        max_output_tokens=24,
        temperature=0,
    )
    second = client.responses.create(
        model="smollm2",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    # The first turn (its input and its answer) is in the second's prompt: the protocol, not
    # the 135M model's memory, is what this asserts.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text
    # The first turn's prompt (and what it generated) came from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_a_strict_schema_answer_validates(server: Server) -> None:
    response = server.client().responses.create(
        model="smollm2",
        input="Name a large city and its country.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)


def _long_chat(turns: int) -> list[dict[str, str]]:
    """A `turns`-turn chat whose first turn gives the user's name and the rest talk rivers."""
    items = [
        {"role": "user", "content": "My name is Alice. Please remember it."},
        {"role": "assistant", "content": "Nice to meet you, Alice! I will remember your name."},
    ]
    rivers = ["Loire", "Seine", "Rhone", "Garonne", "Danube", "Rhine", "Elbe", "Po", "Tagus"]
    for turn in range(1, turns):
        river = rivers[turn % len(rivers)]
        items.append({"role": "user", "content": f"Tell me one fact about the {river}."})
        items.append({"role": "assistant", "content": f"The {river} is a long European river."})
    return items


def test_a_compacted_conversation_still_knows_the_name(server: Server) -> None:
    """30 turns, the name in the first: compacted to the model's list of facts and the last
    two turns, the conversation is under half its tokens and the name is still in it."""
    client = server.client()
    conversation = _long_chat(30)
    compacted = client.responses.compact(model="smollm2", input=conversation)  # type: ignore[arg-type]
    assert compacted.output[0].type == "compaction"
    summary = summary_of(compacted.output[0].encrypted_content)  # type: ignore[union-attr]
    assert "Alice" in summary
    ask = {"role": "user", "content": "What is my name?"}
    follow = [item.model_dump(exclude_none=True) for item in compacted.output] + [ask]
    before = client.responses.input_tokens.count(model="smollm2", input=[*conversation, ask])  # type: ignore[arg-type, list-item]
    after = client.responses.input_tokens.count(model="smollm2", input=follow)  # type: ignore[arg-type]
    assert after.input_tokens < before.input_tokens / 2
    answer = client.responses.create(
        model="smollm2",
        input=follow,  # type: ignore[arg-type]
        max_output_tokens=24,
        temperature=0,
    )
    assert "Alice" in answer.output_text


def test_five_turns_through_a_conversation_remember_the_first(server: Server) -> None:
    """The Conversations API: five turns through one conversation, greedy, and the last one
    answers with the name the first gave (each turn's prompt is the conversation's items).

    A 135M model recalls a name it was told only once it has said it itself (asked "What is
    my name?" after "My name is Alice." it names itself, even in two turns), so the first turn
    asks it to remember the name and its answer greets Alice; no later input names her, so the
    last turn can take the name only from the conversation."""
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
