"""The engine loop in a process of its own, as vLLM runs its EngineCore.

In one process the step loop and the HTTP side share one GIL: every SSE chunk the
event loop writes is time the step's Python waits, and on a small model a step
is mostly Python. Here the engine process owns the LLMEngine and runs the same
loop as AsyncEngine's thread; the gateway process keeps the tokenizer (chat
templates) and the last stats snapshot (/metrics). A grammar compiles in the engine
process alone: the gateway asks it over the pipe (`CompileGrammar`, answered by
`GrammarCompiled`) before it submits the request, so a bad schema is a 400 before
anything is queued, and the request finds its grammar in the engine's cache.

One pipe each way carries the typed messages of engine.messages, pickled: an
`EngineRequest` / `Abort` / `UnloadLoRA` / `CompileGrammar` (and None: stop) in; `Progress`,
then `Ready` or `Fatal` while starting, then per step one `StepResult` (the step's updates, the
requests now finished and, at most every STATS_INTERVAL, an `EngineStats`) and a
`GrammarCompiled` per grammar asked out. A supervisor
thread in the gateway process hands the updates to asyncio (`LoopClient._deliver`).
If the engine process dies, every open request fails with EngineDead (503), /health
says "restarting", and the supervisor starts a new engine process with back-off
(`RestartBackoff`; `restart=None`: it stays dead). The engine process ignores SIGINT and SIGTERM:
a signal to the whole process group (Ctrl-C, a container stop) reaches the gateway,
which drains and stops it in order.

The engine process's side is engine/frontend/engine_main.py. With a `SparePool`
(engine/frontend/warm_spare.py) an engine starts in a spare spawned ahead, torch already
imported, handed its arguments over its pipe (`StartEngine`); with none ready, in a process
spawned then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.errors import EngineDead, GuidedSpecError, StepFailed
from engine.frontend.engine_main import run_engine, start_process
from engine.frontend.facts import EngineFacts
from engine.frontend.grammar_asks import GrammarAsks
from engine.frontend.loop_client import LoopClient
from engine.frontend.warm_spare import SparePool
from engine.frontend.zygote import ForkedProcess, Zygote
from engine.lora.types import LoRALoader, LoRARequest
from engine.messages import (
    CompileGrammar,
    EngineRequest,
    EngineStats,
    Failed,
    Fatal,
    GrammarCompiled,
    Inbound,
    Outbound,
    ProcessInbound,
    Progress,
    Ready,
    Refused,
    StartEngine,
    StepResult,
    Stopped,
)
from engine.request import GuidedSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProcessStart:
    """What an engine process starts with besides its config: the adapters' loader and the
    adapters that fill its LoRA slots before the first request; and where it comes from: a
    warm spare of `spares` (torch already imported), else a fork of `zygote`, else a process
    spawned then."""

    lora_loader: LoRALoader | None = None
    preload: Sequence[LoRARequest] = ()
    spares: SparePool | None = None
    zygote: Zygote | None = None


@dataclass(frozen=True, slots=True)
class RestartBackoff:
    """Restarting a dead engine: the wait doubles after each death or failed start, from
    `first` up to `longest` seconds, and falls back to `first` once an engine has run for
    `reset_after` seconds."""

    first: float = 1.0
    longest: float = 30.0
    reset_after: float = 60.0


# An engine process with no adapters, from wherever it starts first; one restarted as above.
PLAIN_START = ProcessStart()
RESTART = RestartBackoff()


class EngineProcess(LoopClient):
    def __init__(
        self,
        config: EngineConfig,
        *,
        start: ProcessStart = PLAIN_START,
        max_waiting: int = 1024,
        restart: RestartBackoff | None = RESTART,
        tokenizer: Any = None,
    ) -> None:
        """`restart`: how a dead engine process is restarted; None: it stays dead.
        `tokenizer`: the model's, where the caller has it loaded already (a model started on
        demand); None: start() loads it."""
        super().__init__(max_waiting, config.max_num_seqs)
        self.config = config
        self.restart = restart
        self._start = start
        self._process: Any = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        self._stats = EngineStats()
        self._tokenizer: Any = tokenizer
        self._asks = GrammarAsks(config.guided_compile_timeout)
        self._state = "stopped"
        self._started_at = 0.0
        self._restart_delay = 0.0 if restart is None else restart.first

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Spawn the engine process and wait until its model is loaded (`progress` gets
        (tensors loaded, total) as it goes). Raises RuntimeError if it cannot start."""
        self._state = "starting"
        try:
            reported = self._spawn(progress)
        except RuntimeError:
            self._state = "dead"
            raise
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(
                self.config.tokenizer or self.config.model
            )
        self._facts = replace(reported, tokenizer=self._tokenizer)
        self._state = "ok"
        self._supervisor = threading.Thread(
            target=self._supervise, name="engine-supervisor", daemon=True
        )
        self._supervisor.start()

    def _spawn(self, progress: Callable[[int, int], None] | None) -> EngineFacts:
        """Start an engine process and wait for its Ready: the facts it reports."""
        process, conn = self._start_process()
        while True:
            try:
                message: Outbound = conn.recv()
            except EOFError:
                process.join(5)
                raise RuntimeError("the engine process exited while starting") from None
            if isinstance(message, Progress) and progress is not None:
                progress(message.done, message.total)
            elif isinstance(message, Fatal):
                process.join(5)
                raise RuntimeError(f"the engine failed to start: {message.message}")
            elif isinstance(message, Ready):
                facts, self._stats = message.facts, message.stats
                self.load_seconds = message.load_seconds
                break
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()  # a dead engine's end of the pipe
            self._process, self._conn = process, conn
        self._started_at = time.monotonic()
        return facts

    def _start_process(self) -> tuple[BaseProcess | ForkedProcess, Connection]:
        """A warm spare handed this engine's start arguments or, with none ready, a fork of
        the zygote or, without one, a process spawned now; each runs run_engine with them."""
        start = self._start
        spare = start.spares.take() if start.spares is not None else None
        if spare is not None:
            process, conn = spare
            handed = StartEngine(self.config, start.lora_loader, tuple(start.preload), time.time())
            try:
                conn.send(handed)
                self.started_in = "a warm spare"
                return process, conn
            except OSError:  # it died since the pool saw it alive
                conn.close()
        context = mp.get_context("spawn")  # fork would copy this process's torch threads
        conn, child = context.Pipe()
        args = (child, self.config, start.lora_loader, list(start.preload), time.time())
        if start.zygote is not None:
            forked = start.zygote.process(run_engine, args, "loragate-engine")
            child.close()
            self.started_in = "a fork of the zygote"
            return forked, conn
        process = context.Process(target=run_engine, args=args, name="loragate-engine", daemon=True)
        start_process(process)
        child.close()
        self.started_in = "a process spawned for it"
        return process, conn

    @property
    def is_alive(self) -> bool:
        return (
            self._state == "ok"
            and self._process is not None
            and self._process.is_alive()
            and not self._stopping.is_set()
        )

    @property
    def health(self) -> str:
        if self._stopping.is_set():
            return "stopping"
        if self._state == "ok" and not (self._process is not None and self._process.is_alive()):
            return "dead" if self.restart is None else "restarting"
        return self._state

    async def shutdown(self, grace_period: float = 10.0) -> None:
        await self._drain_pending(grace_period)
        with contextlib.suppress(OSError, ValueError, AssertionError):
            self._send(None)  # the engine aborts what is left and exits
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 10.0)
            if self._process.is_alive():
                self._process.terminate()
        if self._supervisor is not None:
            await asyncio.to_thread(self._supervisor.join, 5.0)

    # -- what the gateway reads -----------------------------------------------------------

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        """Asked of the engine process over the pipe: compiled there, into the cache the
        request then finds it in. Raises GuidedSpecError, or EngineDead while none runs."""
        if not self.is_alive:
            raise EngineDead(f"the engine is not serving ({self.health})")

        def send(ticket: int) -> None:
            try:
                self._send(CompileGrammar(ticket, spec))
            except (OSError, ValueError) as exc:
                raise EngineDead("the engine process exited") from exc

        await self._asks.ask(send)

    def stats(self) -> EngineStats:
        return self._stats

    # -- the pipe -------------------------------------------------------------------------------

    def _submit(self, message: Inbound) -> None:
        try:
            self._send(message)
        except (OSError, ValueError):  # the engine process is gone
            if isinstance(message, EngineRequest):
                self._refuse(message.request_id, EngineDead("the engine process exited"))

    def _send(self, message: ProcessInbound | None) -> None:
        assert self._conn is not None, "start() first"
        with self._send_lock:
            self._conn.send(message)

    def _supervise(self) -> None:
        """The supervisor thread: reads the engine's results, and restarts an engine process
        that died (with back-off) unless told not to."""
        while True:
            stopped = self._read()
            self._asks.answer_all(EngineDead("the engine process exited"))  # none will come
            if stopped:
                logger.info("the engine process stopped")
                return
            self._process.join(1.0)
            if self._stopping.is_set():
                logger.info("the engine process stopped (exit code %s)", self._process.exitcode)
                self._refuse_all(EngineDead("the server is shutting down"))
                return
            logger.error(
                "the engine process exited unexpectedly (exit code %s); its requests failed",
                self._process.exitcode,
            )
            self._refuse_all(EngineDead("the engine process exited; this request was lost"))
            if self.restart is None or not self._respawn(self.restart):
                self._state = "dead"
                return

    def _respawn(self, backoff: RestartBackoff) -> bool:
        """Start a new engine process, waiting longer after each quick death; False when the
        server stops first."""
        self._state = "restarting"
        if time.monotonic() - self._started_at > backoff.reset_after:
            self._restart_delay = backoff.first
        while True:
            logger.warning("restarting the engine in %.0f s", self._restart_delay)
            if self._stopping.wait(self._restart_delay):
                return False
            self._restart_delay = min(2 * self._restart_delay, backoff.longest)
            try:
                self._spawn(None)
            except RuntimeError as exc:
                logger.error("the engine did not restart: %s", exc)
                continue
            self._state = "ok"
            logger.info("the engine process is back, started in %s", self.started_in)
            return True

    def _read(self) -> bool:
        """Engine results to the event loops until the pipe closes; True when the engine
        said it stopped, False when it died."""
        assert self._conn is not None
        try:
            while True:
                message: Outbound = self._conn.recv()
                if isinstance(message, StepResult):
                    self._deliver(message.updates, message.finished)
                    if message.stats is not None:
                        self._stats = message.stats
                elif isinstance(message, Refused):
                    self._refuse(message.request_id, message.error)
                elif isinstance(message, Failed):
                    for request_id in message.request_ids:
                        self._refuse(request_id, StepFailed(message.message))
                elif isinstance(message, GrammarCompiled):
                    error = None if message.error is None else GuidedSpecError(message.error)
                    self._asks.answer(message.ticket, error)
                elif isinstance(message, Stopped):
                    self._refuse_all(EngineDead("the server is shutting down"))
                    return True
        except (EOFError, OSError):
            return False
