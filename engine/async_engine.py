"""The engine's step loop, bridged to asyncio: in a thread of this process, or (engine_process)
in a process of its own.

`EngineClient` is what the gateway holds, whichever runs the loop: requests go
in as messages; each request's updates reach its own asyncio queue through
`loop.call_soon_threadsafe`, one wake-up per event loop per step, so no
coroutine ever waits on a step.

`AsyncEngine` runs the loop in one dedicated thread that owns the LLMEngine and
runs `step()` back to back while there is work (torch releases the GIL inside its
ops, so the event loop keeps serving HTTP). Messages reach it through a
thread-safe queue that the loop drains between steps.

Failure containment: an exception inside a forward pass fails only the requests
that cause it (LLMEngine.step pins it on them); anything else the loop raises
fails the requests that were running, frees their blocks, and the loop keeps
serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.errors import EngineDead, EngineOverloaded, StepFailed
from engine.guided import GuidedSpec
from engine.llm_engine import LLMEngine
from engine.lora_types import LoRARequest
from engine.messages import Abort, EngineRequest, EngineStats, Inbound, LoadLoRA, UnloadLoRA
from engine.outputs import SequenceUpdate

logger = logging.getLogger(__name__)


def engine_stats(engine: LLMEngine) -> EngineStats:
    scheduler, lora = engine.scheduler, engine.lora
    # The loop thread mutates these: list() of the running list is one step under the GIL,
    # and the waiting queue iterates over a snapshot.
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    stats = EngineStats(
        num_running=len(running),
        num_waiting=len(waiting),
        kv_cache_usage=engine.kv.usage,
        prefix_cache_queries=engine.kv.num_queried_tokens,
        prefix_cache_hits=engine.kv.num_hit_tokens,
        num_preemptions=scheduler.num_preemptions,
        num_failed_requests=engine.num_failed_requests,
        block_size=engine.kv.block_size,
        num_kv_blocks=engine.kv.pool.num_blocks,
    )
    if engine.speculative is not None:
        stats.spec_decode = (
            engine.num_drafts,
            engine.num_draft_tokens,
            engine.num_accepted_tokens,
        )
    if lora is not None:
        stats.max_loras = lora.max_loras
        stats.running_adapters = sorted({r.lora.name for r in running if r.lora})
        stats.waiting_adapters = sorted({r.lora.name for r in waiting if r.lora})
        stats.lora_slots_used = len(lora.slot_of)
        stats.resident_adapter_ids = sorted(lora.slot_of)
        stats.cached_adapter_ids = sorted(lora.cpu_cache)
        stats.lora_disk_loads = lora.num_disk_loads
        stats.lora_evictions = lora.num_evictions
        stats.lora_pool_usage = 1.0 - lora.pool.free_units / lora.pool.num_units
    return stats


def contained_step(
    engine: LLMEngine,
) -> tuple[list[SequenceUpdate], tuple[list[str], str] | None]:
    """One step, its failure contained: (updates, None), or ([], (the failed requests' ids,
    the error message)) after an exception, with their blocks freed; the loop goes on."""
    try:
        return engine.step(), None
    except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
        logger.exception("engine step failed")
        return [], (engine.fail_running(), f"engine step failed: {type(exc).__name__}: {exc}")


def finished_parents(engine: LLMEngine, updates: list[SequenceUpdate]) -> list[str]:
    """Caller requests whose every sequence has finished (n > 1 samples of one request
    may finish in the same step)."""
    return [u.request_id for u in updates if u.finished and u.request_id not in engine.parents]


class _Stream:
    """Where one request's updates land on the event loop."""

    __slots__ = ("loop", "queue", "num_unfinished")

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[SequenceUpdate | BaseException] = asyncio.Queue()
        self.num_unfinished = n

    def put(self, item: SequenceUpdate | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineClient(ABC):
    """The gateway's handle on a running engine loop."""

    def __init__(self, max_waiting: int, max_num_seqs: int) -> None:
        self.max_waiting = max_waiting
        self.max_num_seqs = max_num_seqs
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

    @abstractmethod
    async def shutdown(self, grace_period: float = 10.0) -> None:
        """Stop admitting, let running requests finish for `grace_period`, abort the rest."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @abstractmethod
    async def compile_grammar(self, spec: GuidedSpec) -> None:
        """Compile (or find cached) a request's grammar; raises GuidedSpecError."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def _submit(self, message: Inbound) -> None:
        """Hand a message to the loop (any thread)."""

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[SequenceUpdate]:
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


class AsyncEngine(EngineClient):
    """The loop in a thread of this process, owning `engine`."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 1024) -> None:
        super().__init__(max_waiting, engine.config.max_num_seqs)
        self.engine = engine
        self._inbox: queue.SimpleQueue[Inbound | None] = queue.SimpleQueue()
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

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.engine.eos_token_ids))

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        await self.engine.grammars.compile(spec)

    def stats(self) -> EngineStats:
        return engine_stats(self.engine)

    def _submit(self, message: Inbound) -> None:
        self._inbox.put(message)

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
        block = not engine.has_unfinished_requests()
        if not self._drain(block):
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

    def _drain(self, block: bool) -> bool:
        """Apply queued messages; False when told to exit."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            apply_message(self.engine, item, self._refuse)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True


def apply_message(
    engine: LLMEngine, message: Inbound, refuse: Callable[[str, BaseException], None]
) -> None:
    """One message, applied on the loop; `refuse(request_id, exc)` reports a request the
    engine would not take."""
    if isinstance(message, EngineRequest):
        try:
            engine.add(message)
        except Exception as exc:  # noqa: BLE001 - refused requests report to their caller
            refuse(message.request_id, exc)
    elif isinstance(message, UnloadLoRA):
        if engine.lora is not None:
            engine.lora.unload(message.adapter_id)
    elif isinstance(message, LoadLoRA):
        if engine.lora is not None:
            try:
                engine.lora.load_now(message.lora)
            except Exception:  # noqa: BLE001 - a request naming it fails with the reason
                logger.exception("adapter %s did not load", message.lora.adapter_id)
    else:
        engine.abort(message.request_id)  # a no-op for a request that has finished


def _put_all(batch: list[tuple[_Stream, SequenceUpdate]]) -> None:
    for stream, update in batch:
        stream.queue.put_nowait(update)
