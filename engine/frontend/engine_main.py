"""The engine process's side of engine/frontend/engine_process.py: its main (`run_engine`:
load, report ready, then the step loop over the pipe, read by a thread of its own so that a
request that arrives mid-step is known at once: engine/give_way.py) and the environment it is
started with. A fresh process runs it as its target; a warm spare
(engine/frontend/warm_spare.py) runs it when handed its start arguments.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.config import EngineConfig
from engine.errors import GuidedSpecError, RequestRefused
from engine.frontend.loop import (
    apply_message,
    contained_step,
    engine_facts,
    engine_stats,
    finished_parents,
)
from engine.heap import retain_freed_memory
from engine.llm_engine import LLMEngine
from engine.lora.types import LoRALoader, LoRARequest
from engine.messages import (
    CompileGrammar,
    EngineRequest,
    Failed,
    Fatal,
    GrammarCompiled,
    Outbound,
    Progress,
    Ready,
    Refused,
    StepResult,
    Stopped,
)

# Seconds between stats snapshots sent with step results (and one whenever the engine idles).
STATS_INTERVAL = 0.05

# How long an OpenMP thread spins for more work before it sleeps (libgomp, torch's OpenMP on
# Linux): about 0.2 ms. A decode step is a few hundred parallel regions microseconds apart;
# a thread that sleeps between them (OMP_WAIT_POLICY=PASSIVE) is woken for each, and the
# wake-ups (an interrupt between cores, dearer in a VM) cost SmolLM2's two-thread decode
# step more than the second core gives (27 ms, as on one thread, against 19). A thread that
# never sleeps takes the core that the HTTP side and its clients need between steps.
OMP_SPIN_COUNT = "10000"


def omp_wait_settings() -> dict[str, str]:
    """OpenMP reads these when the child loads torch; a setting of the user's is kept."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": OMP_SPIN_COUNT}


# os.environ is the whole process's: one start at a time (the zygote's restart and an
# engine's restart may each start a process).
environ_lock = threading.Lock()


def start_process(process: BaseProcess) -> None:
    """Start a spawned engine (or spare) process with the environment its OpenMP reads when
    it imports torch."""
    with environ_lock, environ(**omp_wait_settings()):
        process.start()


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- the engine process's main ---------------------------------------------------------------


def run_engine(
    conn: Connection,
    config: EngineConfig,
    lora_loader: LoRALoader | None,
    preload: Sequence[LoRARequest],
    spawned_at: float = 0.0,
    tokenizer: Any = None,
) -> None:
    """The engine process's main: load, report ready, then step until told to stop.
    `spawned_at`: when the gateway spawned it (time.time()), to time the process's start;
    `tokenizer`: the model's, loaded ahead (a warm spare's)."""
    entered = time.time()
    if tokenizer is None:
        tokenizer = _zygote_tokenizer(config)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s [engine] %(message)s")
    # The gateway process decides when this one stops (it sends None, or its pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    retain_freed_memory()
    try:
        engine = LLMEngine(
            config, lambda done, total: conn.send(Progress(done, total)), lora_loader, tokenizer
        )
        if engine.lora is not None:
            for lora in preload[: config.max_loras]:
                engine.lora.load_now(lora)
    except Exception as exc:  # noqa: BLE001 - reported to the gateway, which exits
        conn.send(Fatal(f"{type(exc).__name__}: {exc}"))
        return
    facts = replace(engine_facts(engine), tokenizer=None)  # dear to pickle; the gateway has one
    load_seconds = {"process": max(0.0, entered - spawned_at)} if spawned_at else {}
    conn.send(Ready(facts, engine_stats(engine), load_seconds | engine.load_seconds))
    with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):  # the gateway is gone
        _EngineLoop(engine, conn).run()


def _zygote_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer as the zygote loaded it, where this process is its fork."""
    warm = sys.modules.get("engine.frontend.zygote_warm")  # never imported here: importing it warms
    return None if warm is None else warm.preloaded_tokenizer(config.tokenizer or config.model)


class _EngineLoop:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.last_stats = 0.0
        # The loop's thread sends, and so do the grammar cache's compile threads (their answers).
        self._send_lock = threading.Lock()
        # What the inbox thread read off the pipe, with when (time.monotonic()); None: stop.
        self._inbox: queue.SimpleQueue[tuple[Any, float] | None] = queue.SimpleQueue()

    def run(self) -> None:
        engine = self.engine
        reader = threading.Thread(target=self._read, name="engine-inbox", daemon=True)
        reader.start()
        while True:
            busy = engine.has_unfinished_requests()
            took, go_on = self._drain(0.0 if busy else 0.5)
            if not go_on:
                for request_id in list(engine.parents):
                    engine.abort(request_id)
                self._send(Stopped())
                return
            if took and not engine.has_unfinished_requests():
                self._send_step([])  # aborts: the gateway sees them gone
            if not engine.has_unfinished_requests():
                continue
            updates, failure = contained_step(engine)
            if failure is not None:
                self._send(Failed(*failure))
                continue
            self._send_step(updates)

    def _read(self) -> None:
        """The inbox thread: every message off the pipe into the loop's queue, each request
        noted in the engine's `arrivals` first, so that a step of worse bands under way gives
        way to it (engine/give_way.py). The pipe's end (EOF) reads as the stop message."""
        try:
            while True:
                message = self.conn.recv()
                if message is None:
                    self._inbox.put(None)
                    return
                if isinstance(message, EngineRequest):
                    self.engine.arrivals.note(message.priority)
                self._inbox.put((message, time.monotonic()))
        except (EOFError, OSError):  # the gateway is gone
            self._inbox.put(None)

    def _drain(self, wait: float) -> tuple[bool, bool]:
        """Apply every queued message, waiting up to `wait` seconds for the first: (whether
        any came, False when told to stop)."""
        self.engine.arrivals.clear()  # what is queued is taken in now
        try:
            item = self._inbox.get(timeout=wait)
        except queue.Empty:
            return False, True
        while True:
            if item is None:
                return True, False
            message, received_at = item
            if isinstance(message, CompileGrammar):
                self._compile(message)
            else:
                apply_message(self.engine, message, received_at, self._refuse)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True, True

    def _compile(self, ask: CompileGrammar) -> None:
        """Compile into the engine's cache, on its threads, and answer when done: the loop
        steps on meanwhile."""
        try:
            future = self.engine.grammars.submit(ask.spec)
        except GuidedSpecError as exc:  # over the size limit, or refused before
            self._send(GrammarCompiled(ask.ticket, str(exc)))
            return
        future.add_done_callback(lambda done: self._answer(ask.ticket, done))

    def _answer(self, ticket: int, done: Future[Any]) -> None:
        """On the compile thread (or this one, for a spec compiled already)."""
        try:
            result = done.result()
        except Exception as exc:  # noqa: BLE001 - the cache returns refusals; anything else, told
            result = GuidedSpecError(f"the grammar did not compile: {exc}")
        error = str(result) if isinstance(result, GuidedSpecError) else None
        with contextlib.suppress(OSError, ValueError):  # the gateway is gone
            self._send(GrammarCompiled(ticket, error))

    def _send(self, message: Outbound) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _refuse(self, request_id: str, error: BaseException) -> None:
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - an exception that cannot cross: keep its message
            error = RequestRefused(str(error))
        self._send(Refused(request_id, error))

    def _send_step(self, updates: list[Any]) -> None:
        """The step's updates, with the engine's stats at most every STATS_INTERVAL, and
        whenever it goes idle (the gateway sees the last requests gone)."""
        now = time.monotonic()
        stats = None
        idle = not self.engine.has_unfinished_requests()
        if idle or now - self.last_stats >= STATS_INTERVAL:
            stats, self.last_stats = engine_stats(self.engine), now
        if updates or stats is not None:
            self._send(StepResult(updates, finished_parents(self.engine, updates), stats))
