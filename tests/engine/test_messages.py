"""The typed hand-offs across the engine boundary: each survives the engine process's pipe
(pickle) as the same type with the same fields, and a refusal keeps its type and code."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.errors import (
    ContextLengthExceeded,
    EngineDead,
    GuidedSpecError,
    RequestRefused,
    StepFailed,
)
from engine.frontend.facts import EngineFacts
from engine.lora.types import LoRARequest
from engine.messages import (
    Abort,
    EngineRequest,
    EngineStats,
    Failed,
    Fatal,
    Progress,
    Ready,
    Refused,
    SpareReady,
    StartEngine,
    StepResult,
    Stopped,
    UnloadLoRA,
)
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec


def _crossed(message: object) -> object:
    return pickle.loads(pickle.dumps(message))


@pytest.mark.parametrize(
    "message",
    [
        EngineRequest(
            "r-1",
            [1, 2, 3],
            SamplingParams(max_tokens=4, guided=GuidedSpec(choice=["a", "b"])),
            LoRARequest("mine", "/adapters/mine", "ab" * 32),
            cache_salt="salt",
            fairness_key="tenant",
            fairness_weight=2.5,
        ),
        EngineRequest("r-2", "text", SamplingParams()),
        Abort("r-1"),
        UnloadLoRA("ab" * 32),
        Progress(3, 7),
        Ready(EngineFacts(None, 49152, 2048, (0, 2)), EngineStats(num_running=1)),
        Fatal("OSError: no checkpoint"),
        StepResult([SequenceUpdate("r-1", 0, [5], "x", None, 3, 0)], ["r-1"], None),
        Failed(["r-1", "r-2"], "engine step failed: RuntimeError: boom"),
        Stopped(),
        SpareReady(),
        StartEngine(
            EngineConfig(model="models/demo", max_loras=2),
            None,
            (LoRARequest("mine", "/adapters/mine", "ab" * 32),),
            1_700_000_000.5,
        ),
    ],
)
def test_each_message_crosses_the_pipe_whole(message: object) -> None:
    assert _crossed(message) == message


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RequestRefused("the prompt is empty"), "invalid_value"),
        (ContextLengthExceeded("this model's maximum context length is 64 tokens"), None),
        (GuidedSpecError("the schema is not valid"), "invalid_grammar"),
    ],
)
def test_a_refusal_keeps_its_type_and_code_across_the_pipe(
    error: RequestRefused, code: str | None
) -> None:
    refused = _crossed(Refused("r", error))
    assert isinstance(refused, Refused)
    assert type(refused.error) is type(error) and str(refused.error) == str(error)
    assert isinstance(refused.error, ValueError)  # what callers of the old API caught
    assert refused.error.code == (code or "context_length_exceeded")


def test_failures_are_runtime_errors_but_not_refusals() -> None:
    for error in (EngineDead("gone"), StepFailed("boom")):
        assert isinstance(error, RuntimeError) and not isinstance(error, ValueError)


def test_the_engine_refuses_by_type_not_by_message(demo_model_dir: Path) -> None:
    llm = LLM(str(demo_model_dir), kv_cache_memory=16 << 20, max_model_len=64)
    engine = llm.engine
    with pytest.raises(ContextLengthExceeded):
        engine.add(EngineRequest("long", [5] * 60, SamplingParams(max_tokens=10)))
    with pytest.raises(RequestRefused) as empty:
        engine.add(EngineRequest("empty", [], SamplingParams(max_tokens=1)))
    assert not isinstance(empty.value, ContextLengthExceeded)
    with pytest.raises(RequestRefused, match="fairness_weight"):
        engine.add(EngineRequest("w", [5], SamplingParams(max_tokens=1), fairness_weight=0.0))
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
