"""Warm spares (engine/frontend/warm_spare.py): an engine started in a spare serves what one
started in a fresh process does; the pool starts another after a take; a spare stops when its
pipe closes, and close() leaves no process behind, ready or still importing.

One pool serves the module: a spare takes seconds to import torch.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import EngineConfig, SamplingParams
from engine.frontend.engine_process import EngineProcess, ProcessStart
from engine.frontend.warm_spare import SparePool
from engine.messages import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 77, 301, 1200, 42], [9, 640, 18]]
READY = 300.0  # seconds a spare may take to be ready (a slow machine, the kernels built)


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        kv_cache_memory=32 << 20,
        max_model_len=256,
        max_num_seqs=4,
        num_threads=1,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def pool(demo_model_dir: Path) -> Iterator[SparePool]:
    # As the gateway makes them: heap faulted in ahead, the model's tokenizer loaded and its
    # checkpoint mapped.
    pool = SparePool(1, heap_bytes=64 << 20, models=[_config(demo_model_dir)])
    pool.start()
    assert pool.wait_ready(READY)
    yield pool
    pool.close()


def _spares() -> list[mp.process.BaseProcess]:
    return [p for p in mp.active_children() if p.name == "loragate-spare"]


async def _tokens(engine: EngineProcess, adapter: object = None) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        # Ids never reused: a finished request's id is forgotten by the supervisor thread,
        # which may come after a request of the same id was sent.
        request_id = f"{'lora' if adapter else 'base'}-{i}"
        request = EngineRequest(request_id, prompt, GREEDY, lora=adapter)  # type: ignore[arg-type]
        async for update in engine.generate(request):
            tokens.extend(update.new_token_ids)
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


async def _serve(
    model_dir: Path, registry: AdapterRegistry, spares: SparePool | None
) -> tuple[int, list[list[int]], list[list[int]]]:
    """An engine (with an adapter preloaded): its pid, base tokens, the adapter's tokens."""
    lora = registry.get("r8-all")
    engine = EngineProcess(
        _config(model_dir),
        start=ProcessStart(registry.loader, [lora], spares),  # type: ignore[list-item]
    )
    engine.start()
    try:
        return engine._process.pid, await _tokens(engine), await _tokens(engine, lora)
    finally:
        await engine.shutdown(0)


async def test_an_engine_in_a_spare_serves_as_a_fresh_one_and_the_pool_refills(
    pool: SparePool, demo_model_dir: Path, demo_adapters: dict[str, Path]
) -> None:
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    registry.register("r8-all", demo_adapters["r8-all"])
    (spare_pid,) = pool.ready_pids()

    pid, base, adapted = await _serve(demo_model_dir, registry, pool)
    assert pid == spare_pid  # the engine ran in the spare
    fresh_pid, fresh_base, fresh_adapted = await _serve(demo_model_dir, registry, None)
    assert fresh_pid != spare_pid
    assert base == fresh_base and adapted == fresh_adapted and adapted != base

    assert pool.wait_ready(READY)  # another spare, started after the take
    (refilled,) = pool.ready_pids()
    assert refilled != spare_pid


def test_a_spare_whose_pipe_closes_exits(pool: SparePool) -> None:
    assert pool.wait_ready(READY)
    spare = pool.take()
    assert spare is not None
    process, conn = spare
    conn.close()  # as when the gateway is gone
    process.join(30)
    assert process.exitcode == 0


def test_a_dead_spare_is_not_handed_out(pool: SparePool) -> None:
    assert pool.wait_ready(READY)
    (pid,) = pool.ready_pids()
    os.kill(pid, signal.SIGKILL)
    for process in _spares():
        if process.pid == pid:
            process.join(30)
    assert pool.take() is None


def test_close_leaves_no_spare_ready_or_starting(pool: SparePool) -> None:
    assert pool.wait_ready(READY)
    starting = SparePool(1)
    starting.start()
    for _ in range(600):  # until its spare is spawned: it is still importing when closed
        if len(_spares()) == 2:
            break
        time.sleep(0.01)
    pool.close()
    starting.close()
    assert _spares() == []
    assert pool.take() is None and not pool.wait_ready(0)
