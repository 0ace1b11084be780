"""A model's engine that starts on its first request and stops when nobody calls it.

A model with `min_replicas: 0` has no engine until a request names it. That request, and the
ones behind it, are held (at most `max_pending`; past that, or past `cold_start_timeout`
seconds, a 503 with Retry-After) while the engine starts, then served in order. After
`idle_timeout` seconds with no request in flight or held, the engine shuts down and its memory
goes back to the machine (an engine process exits). A dead engine is replaced on the next
request. With `min_replicas: 1` the engine starts with the server and never idles out.

The gateway reads the model's facts (tokenizer, vocabulary, context length) from its directory
(EngineFacts.read), so a request is tokenized and checked at the edge before any engine exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from engine.errors import EngineDead, EngineOverloaded
from engine.frontend.client import EngineClient, Scaling
from engine.frontend.facts import EngineFacts
from engine.frontend.loop_client import LoopClient
from engine.load_timings import describe
from engine.messages import EngineRequest, EngineStats
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    min_replicas: int = 1  # 0: scale to zero
    idle_timeout: float = 300.0  # seconds with nothing in flight or held before a stop
    max_pending: int = 256  # requests held while the engine starts
    cold_start_timeout: float = 60.0  # seconds a held request waits before a 503


class OnDemandEngine(EngineClient):
    """One model's engine behind the gateway's engine interface, started on demand.

    `start` builds and starts an engine (blocking: a process spawned and loaded, or a loop in
    a thread); it runs in a worker thread so that the event loop keeps serving other models.
    """

    def __init__(
        self,
        name: str,
        start: Callable[[], LoopClient],
        facts: EngineFacts,
        policy: ScalePolicy,
        on_cold_start: Callable[[float], None] | None = None,
        max_num_seqs: int = 256,
    ) -> None:
        self.name = name
        self.max_num_seqs = max_num_seqs  # what one engine runs at once (a pool reads it)
        self._start_engine = start
        self._facts = facts
        self.policy = policy
        self.on_cold_start = on_cold_start
        self._engine: LoopClient | None = None
        self._starting: asyncio.Task[LoopClient] | None = None
        self._idle_watch: asyncio.Task[None] | None = None
        self._transition = asyncio.Lock()  # a start and a stop never overlap
        self.num_held = 0  # requests waiting for the engine to start
        self.num_in_flight = 0  # requests (and grammar compiles) the engine is serving
        self.num_cold_starts = 0
        self._last_used = time.monotonic()
        self._closed = False

    # -- what the gateway reads --------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    def scaling(self) -> Scaling:
        """Ready: 0 or 1 (its engine, alive); its starts; the requests held for one."""
        ready = int(self._engine is not None and self._engine.is_alive)
        return Scaling(ready, self.num_cold_starts, self.num_held)

    @property
    def health(self) -> str:
        """ok while the model can serve: scaled to zero is ok, it starts when called."""
        if self._closed:
            return "stopping"
        return "ok" if self._engine is None else self._engine.health

    def stats(self) -> EngineStats:
        return EngineStats() if self._engine is None else self._engine.stats()

    @property
    def client(self) -> LoopClient | None:
        """The engine, while there is one (it may have died since: its health says)."""
        return self._engine

    @property
    def is_starting(self) -> bool:
        """An engine is being started for the requests held."""
        return self._starting is not None

    @property
    def last_used(self) -> float:
        """time.monotonic() when a request last finished or the engine last started: the idle
        watch's clock."""
        return self._last_used

    # -- lifecycle -----------------------------------------------------------------------------

    def start_now(self) -> None:
        """Start the engine before serving (min_replicas 1), blocking."""
        self._engine = self._start_engine()
        self.num_cold_starts += 1

    def wake(self) -> None:
        """Start the engine ahead of any request (a pool scaling up); nothing when it runs or
        is starting. A start that fails is logged; the next request tries again."""
        running = self._engine is not None and self._engine.is_alive
        if self._closed or running or self._starting is not None:
            return
        self._starting = asyncio.create_task(self._cold_start(time.monotonic()))
        self._starting.add_done_callback(_retrieve)

    async def shutdown(self, grace_period: float = 10.0) -> None:
        self._closed = True
        if self._idle_watch is not None:
            self._idle_watch.cancel()
        if self._starting is not None:
            try:
                self._engine = await self._starting
            except Exception:  # noqa: BLE001 - a failed start leaves nothing to stop
                self._engine = None
        if self._engine is not None:
            await self._engine.shutdown(grace_period)
            self._engine = None

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[SequenceUpdate]:
        engine = await self._acquire()
        try:
            async for update in engine.generate(request):
                yield update
        finally:
            self._release()

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        engine = await self._acquire()
        try:
            await engine.compile_grammar(spec)
        finally:
            self._release()

    def unload_lora(self, adapter_id: str) -> None:
        if self._engine is not None:  # an engine that is not running holds no adapter
            self._engine.unload_lora(adapter_id)

    async def _acquire(self) -> LoopClient:
        """The running engine, started if there is none; counts the caller in flight."""
        engine = self._engine
        if engine is None or (not engine.is_alive and self.policy.min_replicas == 0):
            engine = await self._wait_for_start()
        self.num_in_flight += 1
        return engine

    def _release(self) -> None:
        self.num_in_flight -= 1
        self._last_used = time.monotonic()

    async def _wait_for_start(self) -> LoopClient:
        if self._closed:
            raise EngineDead(f"the model {self.name!r} is stopping")
        if self.num_held >= self.policy.max_pending:
            raise EngineOverloaded(
                f"the model {self.name!r} is starting and {self.num_held} requests wait for it"
            )
        self.num_held += 1
        held = time.monotonic()
        try:
            if self._starting is None:
                self._starting = asyncio.create_task(self._cold_start(held))
            try:
                return await asyncio.wait_for(
                    asyncio.shield(self._starting), self.policy.cold_start_timeout
                )
            except TimeoutError:
                raise EngineOverloaded(
                    f"the model {self.name!r} did not start within "
                    f"{self.policy.cold_start_timeout:g} s"
                ) from None
        finally:
            self.num_held -= 1

    async def _cold_start(self, held: float) -> LoopClient:
        try:
            async with self._transition:
                dead, self._engine = self._engine, None
                if dead is not None:  # it died: what it held is gone with it
                    await dead.shutdown(0)
                logger.info("starting an engine for %r", self.name)
                try:
                    engine = await asyncio.to_thread(self._start_engine)
                except Exception as exc:
                    logger.exception("the engine for %r failed to start", self.name)
                    raise EngineDead(f"the model {self.name!r} failed to start: {exc}") from exc
                self._engine = engine
                self.num_cold_starts += 1
                self._last_used = time.monotonic()
                seconds = self._last_used - held
                phases, where = engine.load_seconds, engine.started_in
                logger.info(
                    "engine for %r ready in %.2f s%s%s",
                    self.name,
                    seconds,
                    f", in {where}" if where else "",
                    f" ({describe(phases)})" if phases else "",
                )
                if self.on_cold_start is not None:
                    self.on_cold_start(seconds)
                if self.policy.min_replicas == 0 and self._idle_watch is None:
                    self._idle_watch = asyncio.create_task(self._stop_when_idle())
                return engine
        finally:
            self._starting = None

    async def _stop_when_idle(self) -> None:
        """Stop the engine once nothing has been in flight or held for idle_timeout."""
        timeout = self.policy.idle_timeout
        while not self._closed:
            await asyncio.sleep(min(1.0, timeout / 4))
            idle = time.monotonic() - self._last_used
            if self._engine is None or self.num_in_flight or self.num_held or idle < timeout:
                continue
            async with self._transition:
                engine = self._engine
                if engine is None or self.num_in_flight or self.num_held:
                    continue
                self._engine = None
                logger.info("no request for %r in %.0f s: stopping its engine", self.name, idle)
                await engine.shutdown(0)


def _retrieve(task: asyncio.Task[LoopClient]) -> None:
    """A woken start's failure was logged by _cold_start: nobody awaits it."""
    if not task.cancelled():
        task.exception()
