"""EngineProcess: the step loop in its own process, behind the same EngineClient as the thread.

One engine process serves the module (spawning one loads torch and the model again);
the test that kills its process starts its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from poison import poisoned, tokens_or_error, victims

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import LLM, EngineConfig, SamplingParams
from engine.errors import EngineDead, EngineOverloaded, GuidedSpecError
from engine.frontend.engine_process import EngineProcess, ProcessStart
from engine.messages import EngineRequest
from engine.request import GuidedSpec

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 77, 301, 1200, 42], [9, 640, 18], list(range(100, 160)), [2200, 31, 7, 7, 7, 7]]


def _config(model_dir: Path, **overrides: object) -> EngineConfig:
    base: dict[str, object] = {
        "model": str(model_dir),
        "kv_cache_memory": 32 << 20,
        "max_model_len": 256,
        "max_num_seqs": 4,
        "num_threads": 1,
        "dtype": "float32",
    }
    return EngineConfig(**(base | overrides))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def registry(demo_model_dir: Path, demo_adapters: dict[str, Path]) -> AdapterRegistry:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    registry.register("r8-all", demo_adapters["r8-all"])
    return registry


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(demo_model_dir: Path, registry: AdapterRegistry) -> AsyncIterator[EngineProcess]:
    progress: list[tuple[int, int]] = []
    engine = EngineProcess(
        _config(demo_model_dir),
        start=ProcessStart(registry.loader, [registry.get("r8-all")]),  # type: ignore[list-item]
        max_waiting=2,
    )
    engine.start(progress=lambda done, total: progress.append((done, total)))
    assert progress and progress[-1][0] == progress[-1][1], "model loading reports progress"
    yield engine
    await engine.shutdown(0)


async def _tokens(
    engine: EngineProcess, request_id: str, prompt: list[int], **kw: object
) -> list[int]:
    tokens: list[int] = []
    params = kw.pop("params", GREEDY)
    request = EngineRequest(request_id, prompt, params, **kw)  # type: ignore[arg-type]
    async for update in engine.generate(request):
        tokens.extend(update.new_token_ids)
    return tokens


async def _idle(engine: EngineProcess) -> bool:
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            return True
        await asyncio.sleep(0.02)
    return False


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_outputs_equal_the_offline_engine(
    engine: EngineProcess, demo_model_dir: Path, registry: AdapterRegistry
) -> None:
    offline = LLM(
        str(demo_model_dir),
        kv_cache_memory=32 << 20,
        max_model_len=256,
        lora_loader=registry.load,
        dtype="float32",
    )
    lora = registry.get("r8-all")
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)]
    expected_lora = offline.generate(PROMPTS[:1], GREEDY, lora_request=lora)[0].outputs[0].token_ids
    got = await asyncio.gather(
        *(_tokens(engine, f"p{i}", p) for i, p in enumerate(PROMPTS)),
        _tokens(engine, "lora", PROMPTS[0], lora=lora),
    )
    assert list(got[:-1]) == expected
    assert got[-1] == expected_lora != expected[0]
    assert await _idle(engine)
    assert engine.stats().lora_slots_used == 1 and engine.stats().max_loras == 4


async def test_a_refused_request_raises_and_the_engine_keeps_serving(engine: EngineProcess) -> None:
    with pytest.raises(ValueError, match="context length"):
        await _tokens(engine, "too-long", list(range(1, 300)))
    assert len(await _tokens(engine, "after", PROMPTS[1])) == GREEDY.max_tokens


async def test_leaving_early_aborts_in_the_engine(engine: EngineProcess) -> None:
    endless = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = engine.generate(EngineRequest("early", PROMPTS[0], endless))
    async for _ in stream:
        break
    await stream.aclose()
    assert await _idle(engine)


async def test_full_queue_is_refused(engine: EngineProcess) -> None:
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    tasks = [
        asyncio.create_task(_tokens(engine, f"q{i}", PROMPTS[1], params=long)) for i in range(6)
    ]
    await asyncio.sleep(0)
    with pytest.raises(EngineOverloaded):
        await _tokens(engine, "one-too-many", PROMPTS[1])
    assert [len(t) for t in await asyncio.gather(*tasks)] == [60] * 6
    assert await _idle(engine)


async def test_grammars_compile_in_the_engine_process_asked_over_the_pipe(
    engine: EngineProcess,
) -> None:
    spec = GuidedSpec(choice=("yes", "no"))
    await engine.compile_grammar(spec)
    params = SamplingParams(temperature=0, max_tokens=4, guided=spec)
    text = ""
    async for update in engine.generate(EngineRequest("guided", PROMPTS[0], params)):
        text += update.text_delta
    assert text in ("yes", "no")
    with pytest.raises(GuidedSpecError, match="cannot compile the regex"):
        await engine.compile_grammar(GuidedSpec(regex="(unclosed"))
    with pytest.raises(GuidedSpecError, match="the limit is"):  # refused before compiling
        await engine.compile_grammar(GuidedSpec(regex="a" * (65 << 10)))
    assert engine.facts.max_model_len == 256
    assert engine.facts.tokenizer.decode([5, 77])


async def test_a_poisoned_request_fails_alone(engine: EngineProcess, demo_model_dir: Path) -> None:
    """One of sixteen makes the step raise in the engine process: it alone fails."""
    requests = victims()
    requests.insert(4, poisoned(fail_from=3))
    offline = LLM(str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=256, dtype="float32")
    clean = [o.outputs[0].token_ids for o in offline.generate(*zip(*victims(), strict=True))]

    engine.max_waiting = len(requests)  # the module's engine queues two; these all queue
    try:
        got = await asyncio.gather(
            *(tokens_or_error(engine, f"v{i}", p, s) for i, (p, s) in enumerate(requests))
        )
    finally:
        engine.max_waiting = 2
    error = got.pop(4)
    assert isinstance(error, str) and "Poison" in error
    assert got == clean
    assert await _idle(engine)
    assert engine.stats().num_failed_requests >= 1 and engine.is_alive


async def _kill_while_running(engine: EngineProcess, request_id: str) -> None:
    """SIGKILL the engine while a request runs: after its first token, with 249 to go
    (the prompt and max_tokens fill max_model_len), so it cannot finish first."""
    long = SamplingParams(temperature=0, max_tokens=251, ignore_eos=True)
    stream = engine.generate(EngineRequest(request_id, PROMPTS[0], long))
    await anext(stream)
    os.kill(engine._process.pid, signal.SIGKILL)
    with pytest.raises(EngineDead, match="exited"):
        async for _ in stream:
            pass


async def test_a_dead_engine_fails_open_requests(demo_model_dir: Path) -> None:
    engine = EngineProcess(_config(demo_model_dir), restart=None)
    engine.start()
    await _kill_while_running(engine, "doomed")
    assert not engine.is_alive and engine.health == "dead"
    with pytest.raises(EngineDead):
        await _tokens(engine, "after", PROMPTS[0])
    with pytest.raises(EngineDead):  # no engine to compile a grammar either
        await engine.compile_grammar(GuidedSpec(choice=("yes", "no")))
    await engine.shutdown(0)


async def test_a_dead_engine_restarts(demo_model_dir: Path) -> None:
    engine = EngineProcess(_config(demo_model_dir))
    engine.start()
    first_pid = engine._process.pid
    await _kill_while_running(engine, "doomed")
    assert engine.health in ("restarting", "ok")
    for _ in range(1200):  # the new process loads the model (seconds)
        if engine.is_alive:
            break
        if engine.health == "restarting":
            with pytest.raises(EngineDead, match="restarting"):
                await _tokens(engine, "during", PROMPTS[0])
        await asyncio.sleep(0.05)
    assert engine.is_alive and engine.health == "ok" and engine._process.pid != first_pid
    assert len(await _tokens(engine, "after", PROMPTS[1])) == GREEDY.max_tokens
    await engine.shutdown(0)


async def test_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    engine = EngineProcess(EngineConfig(model=str(tmp_path / "no-model-here")))
    with pytest.raises(RuntimeError, match="engine failed to start|exited while starting"):
        engine.start()
    assert not engine.is_alive
