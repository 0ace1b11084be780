"""An engine whose requests of one max_tokens value stall after their first update, so that a
test whose client gives up waiting does so however fast this machine generates (a time-out
that only a slow enough machine reaches passes on one processor and fails on another)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from engine.frontend.async_engine import AsyncEngine
from engine.messages import EngineRequest

# A request asking for this many tokens is held until its client hangs up.
HELD_MAX_TOKENS = 777
# Longer than any test waits: a held request ends by its client's hang-up, never by this.
HOLD_SECONDS = 120.0


class HoldingEngine:
    """The real engine; a request with max_tokens HELD_MAX_TOKENS reaches it and yields its
    first update, then waits for the gateway to cancel it (its client is gone)."""

    def __init__(self, engine: AsyncEngine | Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        stream = self._engine.generate(request)
        return _held(stream) if request.params.max_tokens == HELD_MAX_TOKENS else stream


async def _held(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for update in stream:
        yield update
        await asyncio.sleep(HOLD_SECONDS)
