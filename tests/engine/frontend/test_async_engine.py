"""AsyncEngine: the step loop thread, backpressure, early exit, graceful shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from poison import poisoned, tokens_or_error, victims

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.errors import EngineDead, EngineOverloaded
from engine.frontend.async_engine import AsyncEngine
from engine.messages import EngineRequest

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def core(demo_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(demo_model_dir),
            kv_cache_memory=32 << 20,
            max_model_len=256,
            max_num_seqs=2,
            dtype="float32",
        )
    )


def all_free(core: LLMEngine) -> bool:
    return core.kv.num_free_blocks == core.kv.pool.num_blocks and not core.parents


async def collect(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for update in engine.generate(EngineRequest(request_id, "Once upon a time", params)):
        tokens.extend(update.new_token_ids)
    return tokens


async def test_full_queue_is_refused_and_nothing_leaks(core: LLMEngine) -> None:
    engine = AsyncEngine(core, max_waiting=1)  # 2 running + 1 waiting
    engine.start()
    tasks = [asyncio.create_task(collect(engine, f"r{i}", LONG)) for i in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(EngineOverloaded):
        await collect(engine, "one-too-many", LONG)
    assert [len(t) for t in await asyncio.gather(*tasks)] == [40, 40, 40]
    assert all_free(core)
    await engine.shutdown(0)


async def test_leaving_early_aborts_and_frees(core: LLMEngine) -> None:
    engine = AsyncEngine(core)
    engine.start()
    stream = engine.generate(EngineRequest("early", "Once upon a time", LONG))
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        if all_free(core):
            break
        await asyncio.sleep(0.02)
    assert all_free(core)
    await engine.shutdown(0)


async def _running(engine: AsyncEngine, request_id: str, params: SamplingParams) -> asyncio.Task:
    """A task collecting a request's tokens, returned once the request has its first one."""
    started = asyncio.Event()

    async def run() -> list[int]:
        tokens: list[int] = []
        async for update in engine.generate(EngineRequest(request_id, "Once upon a time", params)):
            tokens.extend(update.new_token_ids)
            started.set()
        return tokens

    task = asyncio.create_task(run())
    await started.wait()
    return task


async def test_shutdown_lets_running_requests_finish(core: LLMEngine) -> None:
    engine = AsyncEngine(core)
    engine.start()
    task = await _running(engine, "graceful", LONG)
    await engine.shutdown(grace_period=30)
    assert len(await task) == 40
    assert not engine.is_alive
    with pytest.raises(EngineDead):
        await collect(engine, "after", LONG)
    assert all_free(core)


async def test_shutdown_past_the_grace_period_aborts(core: LLMEngine) -> None:
    engine = AsyncEngine(core)
    engine.start()
    endless = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    task = await _running(engine, "cut", endless)
    await engine.shutdown(grace_period=0)
    with pytest.raises(EngineDead, match="shutting down"):
        await task
    assert all_free(core)


async def test_a_poisoned_request_fails_alone(core: LLMEngine, demo_model_dir: Path) -> None:
    """One of sixteen makes the step raise in the loop thread: it alone fails."""
    requests = victims()
    requests.insert(9, poisoned(fail_from=2))
    offline = LLM(str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=256, dtype="float32")
    clean = [o.outputs[0].token_ids for o in offline.generate(*zip(*victims(), strict=True))]
    engine = AsyncEngine(core)
    engine.start()

    got = await asyncio.gather(
        *(tokens_or_error(engine, f"v{i}", p, s) for i, (p, s) in enumerate(requests))
    )
    error = got.pop(9)
    assert isinstance(error, str) and "Poison" in error
    assert got == clean
    assert all_free(core) and engine.is_alive
    await engine.shutdown(0)
