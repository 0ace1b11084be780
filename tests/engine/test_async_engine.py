"""AsyncEngine: the step loop thread, backpressure, early exit, graceful shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def core(demo_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=256, max_num_seqs=2
        )
    )


def all_free(core: LLMEngine) -> bool:
    return core.kv.num_free_blocks == core.kv.pool.num_blocks and not core.parents


async def collect(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for update in engine.generate(request_id, "Once upon a time", params):
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
    stream = engine.generate("early", "Once upon a time", LONG)
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        if all_free(core):
            break
        await asyncio.sleep(0.02)
    assert all_free(core)
    await engine.shutdown(0)


async def test_shutdown_lets_running_requests_finish(core: LLMEngine) -> None:
    engine = AsyncEngine(core)
    engine.start()
    task = asyncio.create_task(collect(engine, "graceful", LONG))
    await asyncio.sleep(0.05)
    await engine.shutdown(grace_period=30)
    assert len(await task) == 40
    assert not engine.is_alive
    with pytest.raises(EngineDead):
        await collect(engine, "after", LONG)
    assert all_free(core)


async def test_shutdown_past_the_grace_period_aborts(core: LLMEngine) -> None:
    engine = AsyncEngine(core)
    engine.start()
    endless = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    task = asyncio.create_task(collect(engine, "cut", endless))
    await asyncio.sleep(0.05)
    await engine.shutdown(grace_period=0)
    with pytest.raises(EngineDead, match="shutting down"):
        await task
    assert all_free(core)
