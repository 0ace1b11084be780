"""`AsyncEngine`: the engine loop in one dedicated thread of this process, owning the
LLMEngine and running `step()` back to back while there is work (torch releases the GIL inside
its ops, so the event loop keeps serving HTTP). Messages reach it through a thread-safe queue
that the loop drains between steps (each request noted in the engine's `arrivals` as it is
queued, so that a step of worse bands gives way to it: engine/give_way.py). The loop's body
is engine/frontend/loop.py's, as in an engine process; the gateway's side is
engine/frontend/loop_client.py's.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from engine.errors import EngineDead, StepFailed
from engine.frontend.loop import (
    apply_message,
    contained_step,
    engine_facts,
    engine_stats,
    finished_parents,
)
from engine.frontend.loop_client import LoopClient
from engine.guided import GuidedSpec
from engine.llm_engine import LLMEngine
from engine.messages import EngineRequest, EngineStats, Inbound

logger = logging.getLogger(__name__)


class AsyncEngine(LoopClient):
    """The loop in a thread of this process, owning `engine`."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 1024) -> None:
        super().__init__(max_waiting, engine.config.max_num_seqs)
        self.engine = engine
        self._facts = engine_facts(engine)
        # What was submitted, with when (time.monotonic()); None: exit.
        self._inbox: queue.SimpleQueue[tuple[Inbound, float] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    async def shutdown(self, grace_period: float = 10.0) -> None:
        await self._drain_pending(grace_period)
        self._inbox.put(None)  # the loop aborts what is left as it exits
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        # The loop's own cache (thread-safe): the request then finds its grammar compiled.
        await self.engine.grammars.compile(spec)

    def stats(self) -> EngineStats:
        return engine_stats(self.engine)

    def _submit(self, message: Inbound) -> None:
        if isinstance(message, EngineRequest):  # a step of worse bands gives way to it
            self.engine.arrivals.note(message.priority)
        self._inbox.put((message, time.monotonic()))

    # -- the loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # noqa: BLE001 - a bug in the loop must not end it
                logger.exception("the engine loop failed; failing its running requests")
                for request_id in self.engine.fail_running():
                    self._refuse(request_id, StepFailed("the engine loop failed"))

    def _iterate(self) -> bool:
        """Apply queued messages, run one step; False when told to exit."""
        engine = self.engine
        # Idle, the loop waits for a message (a while, then it looks again); busy, it steps.
        if not self._drain(0.0 if engine.has_unfinished_requests() else 0.5):
            for request_id in list(self._streams):
                engine.abort(request_id)
            self._refuse_all(EngineDead("the server is shutting down"))
            return False
        if not engine.has_unfinished_requests():
            return True
        updates, failure = contained_step(engine)
        if failure is not None:
            failed, message = failure
            for request_id in failed:
                self._refuse(request_id, StepFailed(message))
            return True
        self._deliver(updates, finished_parents(engine, updates))
        return True

    def _drain(self, wait: float) -> bool:
        """Apply queued messages, waiting up to `wait` seconds for the first; False when told
        to exit."""
        self.engine.arrivals.clear()  # what is queued is taken in now
        try:
            item = self._inbox.get(timeout=wait)
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            apply_message(self.engine, *item, self._refuse)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
