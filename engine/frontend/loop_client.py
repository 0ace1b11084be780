"""`LoopClient`: the gateway's `EngineClient` (engine/frontend/client.py) on a running engine loop,
whichever runs it (a thread of this process, engine/frontend/async_engine.py; a process of its own,
engine/frontend/engine_process.py; a `loragate engine` elsewhere, gateway/remote/remote_engine.py).

Requests go in as messages; each request's updates reach its own asyncio queue through
`loop.call_soon_threadsafe`, one wake-up per event loop per step, so no coroutine ever waits
on a step. A consumer that falls behind the steps (an event loop busy with many long streams)
reads the updates that piled up for one sequence as one, as vLLM's output collector does: it
catches up at the cost of one chunk, not one per step it missed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import AsyncGenerator

from engine.errors import EngineDead, EngineOverloaded
from engine.frontend.client import EngineClient, Scaling
from engine.frontend.facts import EngineFacts
from engine.lora.types import LoRARequest
from engine.messages import Abort, EngineRequest, Inbound, LoadLoRA, UnloadLoRA
from engine.outputs import SequenceUpdate


class _Stream:
    """Where one request's updates land on the event loop."""

    __slots__ = ("loop", "queue", "num_unfinished", "_backlog")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[SequenceUpdate | BaseException] = asyncio.Queue()
        self.num_unfinished = n
        self._backlog: deque[SequenceUpdate | BaseException] = deque()

    def put(self, item: SequenceUpdate | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def next(self) -> SequenceUpdate | BaseException:
        """The next update, merged with the ones of the same sequence queued right behind it
        (never past a finished one, an error, or another sample's update)."""
        if not self._backlog:
            self._backlog.append(await self.queue.get())
        while not self.queue.empty():
            self._backlog.append(self.queue.get_nowait())
        item = self._backlog.popleft()
        while isinstance(item, SequenceUpdate) and not item.finished and self._backlog:
            later = self._backlog[0]
            if not isinstance(later, SequenceUpdate) or later.index != item.index:
                break
            self._backlog.popleft()
            item = item.followed_by(later)
        return item


class LoopClient(EngineClient):
    """The gateway's handle on one running engine loop."""

    def __init__(self, max_waiting: int, max_num_seqs: int) -> None:
        self.max_waiting = max_waiting
        self.max_num_seqs = max_num_seqs
        self._facts: EngineFacts | None = None  # known from the start on
        # The last start's phases, in seconds, and where it ran: an engine process's (a
        # cold start's log line); empty for the others.
        self.load_seconds: dict[str, float] = {}
        self.started_in = ""
        self._streams: dict[str, _Stream] = {}
        self._num_pending = 0  # submitted but not yet finished, across threads
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # -- what a front end provides ----------------------------------------------------------

    @abstractmethod
    def start(self) -> None: ...

    @property
    @abstractmethod
    def is_alive(self) -> bool: ...

    @property
    def health(self) -> str:
        """What /health reports: ok, stopping, restarting or dead."""
        if self._stopping.is_set():
            return "stopping"
        return "ok" if self.is_alive else "dead"

    @property
    def facts(self) -> EngineFacts:
        assert self._facts is not None, "start() first"
        return self._facts

    def scaling(self) -> Scaling:
        """One engine, started with the server: ready while ok, holding nothing."""
        return Scaling(int(self.health == "ok"), 0, 0)

    @abstractmethod
    def _submit(self, message: Inbound) -> None:
        """Hand a message to the loop (any thread)."""

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[SequenceUpdate]:
        """Yield every update of the request's sequences until all have finished.

        Raises what engine.errors names: RequestRefused (a ValueError) for a request the
        engine will not take, EngineOverloaded when the queue is full, EngineDead when no loop
        runs, StepFailed when a step failed with it. Leaving the iteration early (client
        gone) aborts it.
        """
        if not self.is_alive:
            raise EngineDead(f"the engine is not serving ({self.health})")
        with self._lock:
            if self._num_pending >= self.max_waiting + self.max_num_seqs:
                raise EngineOverloaded("too many requests are waiting")
            self._num_pending += 1
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop(), request.params.n)
        self._streams[request_id] = stream
        self._submit(request)
        finished = False
        try:
            while True:
                item = await stream.next()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    stream.num_unfinished -= 1
                    if stream.num_unfinished == 0:
                        finished = True
                        return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._forget(request_id)
        self._submit(Abort(request_id))

    def unload_lora(self, adapter_id: str) -> None:
        """Free an adapter's slot and CPU copy (on the loop, which owns them), at once or
        when its running requests finish."""
        self._submit(UnloadLoRA(adapter_id))

    def load_lora(self, lora: LoRARequest) -> None:
        """Put an adapter in a slot before a request needs it (a free or idle slot)."""
        self._submit(LoadLoRA(lora))

    # -- results, from the loop's side ------------------------------------------------------------

    def _deliver(self, updates: list[SequenceUpdate], finished: list[str]) -> None:
        """One wake-up per event loop per step, not one per token; then forget the
        requests that are done."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, SequenceUpdate]]] = {}
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, update))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)
        for request_id in finished:
            self._forget(request_id)

    def _refuse(self, request_id: str, error: BaseException) -> None:
        """End a request with an exception its caller raises (refused, or failed)."""
        stream = self._streams.get(request_id)
        self._forget(request_id)
        if stream is not None:
            stream.put(error)

    def _forget(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            with self._lock:
                self._num_pending -= 1

    def _refuse_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._refuse(request_id, error)

    async def _drain_pending(self, grace_period: float) -> None:
        deadline = time.monotonic() + grace_period
        self._stopping.set()
        while self._num_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _put_all(batch: list[tuple[_Stream, SequenceUpdate]]) -> None:
    for stream, update in batch:
        stream.queue.put_nowait(update)
