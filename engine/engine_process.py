"""The engine loop in a process of its own, as vLLM runs its EngineCore.

In one process the step loop and the HTTP side share one GIL: every SSE chunk the
event loop writes is time the step's Python waits, and on a small model a step
is mostly Python. Here the engine process owns the LLMEngine and runs the same
loop as AsyncEngine's thread; the gateway process keeps the tokenizer (chat
templates), its own grammar cache (a bad schema is a 400 before anything is
queued) and the last stats snapshot (/metrics).

One pipe each way carries the typed messages of engine.messages, pickled: an
`EngineRequest` / `Abort` / `UnloadLoRA` (and None: stop) in; `Progress`, then `Ready`
or `Fatal` while starting, then per step one `StepResult` (the step's updates, the
requests now finished and, at most every STATS_INTERVAL, an `EngineStats`) out. A supervisor
thread in the gateway process hands the updates to asyncio (`EngineClient._deliver`).
If the engine process dies, every open request fails with EngineDead (503), /health
says "restarting", and the supervisor starts a new engine process with back-off
(`restart=False`: it stays dead). The engine process ignores SIGINT and SIGTERM:
a signal to the whole process group (Ctrl-C, a container stop) reaches the gateway,
which drains and stops it in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from transformers import AutoTokenizer

from engine.async_engine import (
    EngineClient,
    apply_message,
    contained_step,
    engine_stats,
    finished_parents,
)
from engine.config import EngineConfig
from engine.errors import EngineDead, RequestRefused, StepFailed
from engine.guided import GrammarCache, GuidedSpec
from engine.llm_engine import LLMEngine, grammar_cache
from engine.lora_types import LoRALoader, LoRARequest
from engine.messages import (
    EngineInfo,
    EngineRequest,
    EngineStats,
    Failed,
    Fatal,
    Inbound,
    Outbound,
    Progress,
    Ready,
    Refused,
    StepResult,
    Stopped,
)

logger = logging.getLogger(__name__)

# Seconds between stats snapshots sent with step results (and one whenever the engine idles).
STATS_INTERVAL = 0.05
# Restarting a dead engine: the wait doubles after each death or failed start, from MIN up to
# MAX, and falls back to MIN once an engine has run for RESET seconds.
RESTART_DELAY_MIN, RESTART_DELAY_MAX, RESTART_DELAY_RESET = 1.0, 30.0, 60.0


class EngineProcess(EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        *,
        lora_loader: LoRALoader | None = None,
        preload: Sequence[LoRARequest] = (),
        max_waiting: int = 1024,
        restart: bool = True,
        tokenizer: Any = None,
    ) -> None:
        """`tokenizer`: the model's, where the caller has it loaded already (a model started
        on demand); None: start() loads it."""
        super().__init__(max_waiting, config.max_num_seqs)
        self.config = config
        self.restart = restart
        self._lora_loader = lora_loader
        self._preload = list(preload)
        self._process: Any = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        self._info: EngineInfo | None = None
        self._stats = EngineStats()
        self.load_seconds: dict[str, float] = {}  # the last start's phases (Ready)
        self._tokenizer: Any = tokenizer
        self._grammars: GrammarCache | None = None
        self._state = "stopped"
        self._started_at = 0.0
        self._restart_delay = RESTART_DELAY_MIN

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Spawn the engine process and wait until its model is loaded (`progress` gets
        (tensors loaded, total) as it goes). Raises RuntimeError if it cannot start."""
        self._state = "starting"
        try:
            self._spawn(progress)
        except RuntimeError:
            self._state = "dead"
            raise
        info = self._info
        assert info is not None
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(
                self.config.tokenizer or self.config.model
            )
        self._grammars = grammar_cache(
            self.config, self._tokenizer, info.vocab_size, info.eos_token_ids
        )
        self._state = "ok"
        self._supervisor = threading.Thread(
            target=self._supervise, name="engine-supervisor", daemon=True
        )
        self._supervisor.start()

    def _spawn(self, progress: Callable[[int, int], None] | None) -> None:
        context = mp.get_context("spawn")  # fork would copy this process's torch threads
        conn, child = context.Pipe()
        process = context.Process(
            target=run_engine,
            args=(child, self.config, self._lora_loader, self._preload, time.time()),
            name="loragate-engine",
            daemon=True,
        )
        with _environ(**_omp_wait_settings()):
            process.start()
        child.close()
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
                self._info, self._stats = message.info, message.stats
                self.load_seconds = message.load_seconds
                break
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()  # a dead engine's end of the pipe
            self._process, self._conn = process, conn
        self._started_at = time.monotonic()

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
            return "restarting" if self.restart else "dead"
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

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        assert self._info is not None, "start() first"
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self._info is not None, "start() first"
        return self._info.vocab_size

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        assert self._grammars is not None, "start() first"
        await self._grammars.compile(spec)

    def stats(self) -> EngineStats:
        return self._stats

    # -- the pipe -------------------------------------------------------------------------------

    def _submit(self, message: Inbound) -> None:
        try:
            self._send(message)
        except (OSError, ValueError):  # the engine process is gone
            if isinstance(message, EngineRequest):
                self._refuse(message.request_id, EngineDead("the engine process exited"))

    def _send(self, message: Inbound | None) -> None:
        assert self._conn is not None, "start() first"
        with self._send_lock:
            self._conn.send(message)

    def _supervise(self) -> None:
        """The supervisor thread: reads the engine's results, and restarts an engine process
        that died (with back-off) unless told not to."""
        while True:
            if self._read():
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
            if not self.restart or not self._respawn():
                self._state = "dead"
                return

    def _respawn(self) -> bool:
        """Start a new engine process, waiting longer after each quick death; False when the
        server stops first."""
        self._state = "restarting"
        if time.monotonic() - self._started_at > RESTART_DELAY_RESET:
            self._restart_delay = RESTART_DELAY_MIN
        while True:
            logger.warning("restarting the engine in %.0f s", self._restart_delay)
            if self._stopping.wait(self._restart_delay):
                return False
            self._restart_delay = min(2 * self._restart_delay, RESTART_DELAY_MAX)
            try:
                self._spawn(None)
            except RuntimeError as exc:
                logger.error("the engine did not restart: %s", exc)
                continue
            self._state = "ok"
            logger.info("the engine process is back")
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
                elif isinstance(message, Stopped):
                    self._refuse_all(EngineDead("the server is shutting down"))
                    return True
        except (EOFError, OSError):
            return False


# How long an OpenMP thread spins for more work before it sleeps (libgomp, torch's OpenMP on
# Linux): about 0.2 ms. A decode step is a few hundred parallel regions microseconds apart;
# a thread that sleeps between them (OMP_WAIT_POLICY=PASSIVE) is woken for each, and the
# wake-ups (an interrupt between cores, dearer in a VM) cost SmolLM2's two-thread decode
# step more than the second core gives (27 ms, as on one thread, against 19). A thread that
# never sleeps takes the core that the HTTP side and its clients need between steps.
OMP_SPIN_COUNT = "10000"


def _omp_wait_settings() -> dict[str, str]:
    """OpenMP reads these when the child loads torch; a setting of the user's is kept."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": OMP_SPIN_COUNT}


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
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


# -- the engine process ---------------------------------------------------------------------


def run_engine(
    conn: Connection,
    config: EngineConfig,
    lora_loader: LoRALoader | None,
    preload: Sequence[LoRARequest],
    spawned_at: float = 0.0,
) -> None:
    """The engine process's main: load, report ready, then step until told to stop.
    `spawned_at`: when the gateway spawned it (time.time()), to time the process's start."""
    entered = time.time()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s [engine] %(message)s")
    # The gateway process decides when this one stops (it sends None, or its pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    retain_freed_memory()
    try:
        engine = LLMEngine(
            config, lambda done, total: conn.send(Progress(done, total)), lora_loader
        )
        if engine.lora is not None:
            for lora in preload[: config.max_loras]:
                engine.lora.load_now(lora)
    except Exception as exc:  # noqa: BLE001 - reported to the gateway, which exits
        conn.send(Fatal(f"{type(exc).__name__}: {exc}"))
        return
    info = EngineInfo(engine.max_model_len, engine.vocab_size, tuple(sorted(engine.eos_token_ids)))
    load_seconds = {"process": max(0.0, entered - spawned_at)} if spawned_at else {}
    conn.send(Ready(info, engine_stats(engine), load_seconds | engine.load_seconds))
    with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):  # the gateway is gone
        _EngineLoop(engine, conn).run()


def retain_freed_memory() -> None:
    """Keep freed heap memory in the process instead of returning it to the kernel.

    glibc serves allocations from 128 KiB up (adaptively, up to 32 MiB) with fresh
    mmaps and gives them back when freed, so every prefill's activations fault in new
    zeroed pages, which costs as much as the arithmetic on a small model (more in a VM).
    Serving everything up to 32 MiB from the heap, and never trimming it, makes a
    step's buffers the previous step's, already faulted in. (vLLM-CPU asks for tcmalloc
    preloaded for the same reason.)
    """
    import ctypes
    import ctypes.util

    m_trim_threshold, m_mmap_threshold = -1, -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


class _EngineLoop:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.last_stats = 0.0

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            busy = engine.has_unfinished_requests()
            if conn.poll(0 if busy else 0.5):
                if not self._drain():
                    for request_id in list(engine.parents):
                        engine.abort(request_id)
                    conn.send(Stopped())
                    return
                if not engine.has_unfinished_requests():
                    self._send_step([], force_stats=True)  # aborts: the gateway sees them gone
            if not engine.has_unfinished_requests():
                continue
            updates, failure = contained_step(engine)
            if failure is not None:
                conn.send(Failed(*failure))
                continue
            self._send_step(updates, force_stats=not engine.has_unfinished_requests())

    def _drain(self) -> bool:
        """Apply every queued message; False when told to stop."""
        while self.conn.poll(0):
            message = self.conn.recv()
            if message is None:
                return False
            apply_message(self.engine, message, self._refuse)
        return True

    def _refuse(self, request_id: str, error: BaseException) -> None:
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - an exception that cannot cross: keep its message
            error = RequestRefused(str(error))
        self.conn.send(Refused(request_id, error))

    def _send_step(self, updates: list[Any], force_stats: bool) -> None:
        now = time.monotonic()
        stats = None
        if force_stats or now - self.last_stats >= STATS_INTERVAL:
            stats, self.last_stats = engine_stats(self.engine), now
        if updates or stats is not None:
            self.conn.send(StepResult(updates, finished_parents(self.engine, updates), stats))
