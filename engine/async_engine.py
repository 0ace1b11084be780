"""The engine's step loop in its own thread, bridged to asyncio.

One dedicated thread owns the LLMEngine and runs `step()` back to back while
there is work (torch releases the GIL inside its ops, so the event loop keeps
serving HTTP). Requests and aborts enter through a thread-safe queue that the
loop drains between steps; each request's updates reach its own asyncio queue
through `loop.call_soon_threadsafe`, so no coroutine ever waits on a step.

Failure containment: an exception inside a step fails the requests of that
step with an error update, frees their blocks, and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import SequenceUpdate
from engine.request import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class EngineDead(RuntimeError):
    """The step loop is not running (HTTP 503)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    lora: LoRARequest | None
    cache_salt: str | None
    fairness_key: str | None
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _UnloadLoRA:
    adapter_id: str


class _Stream:
    """Where one request's updates land on the event loop."""

    __slots__ = ("loop", "queue", "num_unfinished")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[SequenceUpdate | BaseException] = asyncio.Queue()
        self.num_unfinished = n

    def put(self, item: SequenceUpdate | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting: int = 1024) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[_Add | _Abort | _UnloadLoRA | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._num_pending = 0  # submitted but not yet finished, across threads
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    async def shutdown(self, grace_period: float = 10.0) -> None:
        """Stop admitting, let running requests finish for `grace_period`, abort the rest."""
        deadline = time.monotonic() + grace_period
        self._stopping.set()
        while self._num_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._inbox.put(None)  # the loop aborts what is left as it exits
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # -- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
        fairness_key: str | None = None,
    ) -> AsyncIterator[SequenceUpdate]:
        """Yield every update of the request's sequences until all have finished.

        Raises ValueError for a request the engine refuses, EngineOverloaded when
        the queue is full. Leaving the iteration early (client gone) aborts it.
        """
        if not self.is_alive:
            raise EngineDead("the engine is not running")
        with self._lock:
            if self._num_pending >= self.max_waiting + self.engine.config.max_num_seqs:
                raise EngineOverloaded("too many requests are waiting")
            self._num_pending += 1
        stream = _Stream(asyncio.get_running_loop(), params.n)
        self._inbox.put(_Add(request_id, prompt, params, lora, cache_salt, fairness_key, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
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
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def unload_lora(self, adapter_id: str) -> None:
        """Free an adapter's slot and CPU copy (on the loop thread, which owns them),
        at once or when its running requests finish."""
        self._inbox.put(_UnloadLoRA(adapter_id))

    # -- the loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished_requests()
            if not self._drain(block):
                self._abort_all(EngineDead("the server is shutting down"))
                break
            if not engine.has_unfinished_requests():
                continue
            try:
                updates = engine.step()
            except Exception as exc:  # noqa: BLE001 - contain it: fail the step's requests, keep serving
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._deliver(updates)
            # After delivering: n > 1 samples of one request may finish in the same step.
            for update in updates:
                if update.finished and update.request_id not in engine.parents:
                    self._forget(update.request_id)

    def _deliver(self, updates: list[SequenceUpdate]) -> None:
        """One wake-up per event loop per step, not one per token."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, SequenceUpdate]]] = {}
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, update))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _drain(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when told to exit."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _UnloadLoRA):
                if self.engine.lora is not None:
                    self.engine.lora.unload(item.adapter_id)
            elif item.request_id in self._streams:
                self.engine.abort(item.request_id)
                self._forget(item.request_id)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, item: _Add) -> None:
        try:
            self.engine.add_request(
                item.request_id,
                item.prompt,
                item.params,
                lora=item.lora,
                cache_salt=item.cache_salt,
                fairness_key=item.fairness_key,
            )
        except Exception as exc:  # noqa: BLE001 - refused requests report to their caller
            with self._lock:
                self._num_pending -= 1
            item.stream.put(exc)
            return
        self._streams[item.request_id] = item.stream

    def _forget(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            with self._lock:
                self._num_pending -= 1

    def _abort_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            self._forget(request_id)
            stream.put(error)

    def _fail_all(self, exc: Exception) -> None:
        error = RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}")
        for request_id in self.engine.fail_running():
            stream = self._streams.get(request_id)
            self._forget(request_id)
            if stream is not None:
                stream.put(error)


def _put_all(batch: list[tuple[_Stream, SequenceUpdate]]) -> None:
    for stream, update in batch:
        stream.queue.put_nowait(update)
