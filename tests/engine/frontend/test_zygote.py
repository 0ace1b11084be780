"""The zygote (engine/frontend/zygote.py): an engine forked from it serves what one spawned fresh
does, with the tokenizer the zygote loaded; several start at once; a zygote killed with SIGKILL is
started again, the engines it forked keep serving, and the next start is served; an engine that
fails to start reports it and leaves the zygote alive.

One zygote serves the module: it takes seconds to import torch.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineConfig, SamplingParams
from engine.frontend.engine_process import EngineProcess, ProcessStart
from engine.frontend.zygote import Zygote
from engine.messages import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 77, 301, 1200, 42]


def _config(model: str | Path) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        kv_cache_memory=16 << 20,
        max_model_len=128,
        max_num_seqs=4,
        num_threads=1,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def zygote(demo_model_dir: Path) -> Iterator[Zygote]:
    zygote = Zygote(models=[str(demo_model_dir)])
    zygote.start()
    yield zygote
    zygote.close()


async def _tokens(engine: EngineProcess, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for update in engine.generate(EngineRequest(request_id, PROMPT, GREEDY)):
        tokens.extend(update.new_token_ids)
    return tokens


async def _serve_once(config: EngineConfig, zygote: Zygote | None) -> tuple[int, list[int]]:
    engine = EngineProcess(config, restart=None, start=ProcessStart(zygote=zygote))
    await asyncio.to_thread(engine.start)
    try:
        return engine._process.pid, await _tokens(engine, "one")
    finally:
        await engine.shutdown()


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


async def test_a_forked_engine_serves_as_a_spawned_one(
    demo_model_dir: Path, zygote: Zygote
) -> None:
    config = _config(demo_model_dir)
    forked_pid, forked = await _serve_once(config, zygote)
    spawned_pid, spawned = await _serve_once(config, None)
    assert forked == spawned and len(forked) == GREEDY.max_tokens
    assert zygote.pid is not None
    assert forked_pid != spawned_pid
    assert forked_pid not in _children(os.getpid())  # the zygote's child, not this process's


async def test_several_engines_start_at_once(demo_model_dir: Path, zygote: Zygote) -> None:
    engines = [
        EngineProcess(_config(demo_model_dir), restart=None, start=ProcessStart(zygote=zygote))
        for _ in "abc"
    ]
    await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
    try:
        pids = {e._process.pid for e in engines}
        assert len(pids) == 3 and pids <= _children(zygote.pid or -1)
        answers = await asyncio.gather(*(_tokens(e, f"r{i}") for i, e in enumerate(engines)))
        assert all(a == answers[0] for a in answers)
    finally:
        await asyncio.gather(*(e.shutdown() for e in engines))


async def test_a_killed_zygote_is_restarted_and_its_engines_keep_serving(
    demo_model_dir: Path, zygote: Zygote
) -> None:
    config = _config(demo_model_dir)
    engine = EngineProcess(config, restart=None, start=ProcessStart(zygote=zygote))
    await asyncio.to_thread(engine.start)
    try:
        before = await _tokens(engine, "before")
        old = zygote.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        starts = zygote.starts
        for _ in range(600):  # the watch thread looks every second
            if zygote.starts > starts:
                break
            await asyncio.sleep(0.05)
        assert zygote.starts > starts and zygote.pid != old
        # The engine forked from the dead zygote is alive to us and answers as before.
        assert engine.is_alive and engine.health == "ok"
        assert await _tokens(engine, "after") == before
        _, again = await _serve_once(config, zygote)  # a start from the new zygote
        assert again == before
    finally:
        await engine.shutdown()


async def test_an_engine_that_fails_to_start_leaves_the_zygote_alive(
    tmp_path: Path, demo_model_dir: Path, zygote: Zygote
) -> None:
    engine = EngineProcess(
        _config(tmp_path / "no-such-model"), restart=None, start=ProcessStart(zygote=zygote)
    )
    with pytest.raises(RuntimeError, match="failed to start|exited while starting"):
        await asyncio.to_thread(engine.start)
    pid = zygote.pid
    assert pid is not None
    os.kill(pid, 0)  # still there
    _, tokens = await _serve_once(_config(demo_model_dir), zygote)
    assert len(tokens) == GREEDY.max_tokens and zygote.pid == pid
