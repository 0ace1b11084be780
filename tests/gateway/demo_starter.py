"""Engines on demand in tests: a `start` callable that builds a demo-model engine loop in a
thread of this process, once its gate is open (a cold start held as long as a test needs)."""

from __future__ import annotations

import threading
from pathlib import Path

from engine import EngineConfig, LLMEngine
from engine.frontend.async_engine import AsyncEngine

CONFIG = {"kv_cache_memory": 32 << 20, "max_model_len": 512, "dtype": "float32", "num_threads": 1}


class Starter:
    """Starts a demo-model engine when the gate is open; counts and keeps what it started."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.engines: list[AsyncEngine] = []

    def __call__(self) -> AsyncEngine:
        self.gate.wait()
        if self.fail:
            raise RuntimeError("no memory left for this model")
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(self.model_dir), **CONFIG)))
        engine.start()
        self.engines.append(engine)
        return engine
