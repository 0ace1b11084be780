"""Warm spares: engine processes started ahead, waiting on their pipe to become an engine.

Most of a cold start is the new process's own: the interpreter importing torch, transformers
and the engine (docs: Several models, Cold start). A spare pays that ahead: it is spawned as
an engine process is (the "spawn" context, the same environment), imports what an engine
needs at idle priority, loads the C++ kernels (they depend on the machine, not the model),
says `SpareReady` and blocks on its pipe (engine/frontend/spare_main.py). `EngineProcess` takes a
ready one from the pool and sends it a `StartEngine`; the spare then runs `run_engine` with
those arguments, and its pipe carries what a fresh engine's does. The pool starts another
in the background for the next cold start.

    gateway ── SparePool ── take() ──▶ (process, pipe) ── StartEngine ──▶ run_engine
                  └ refill thread: spawn, wait for SpareReady, keep `size` ready

A spare holds nothing of a model's, so stopping one is harmless: it exits when its pipe
closes (the pool's close(), or the gateway gone), and close() kills one still importing.
Like an engine it ignores SIGINT and SIGTERM: the gateway decides when it stops.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from engine import heap
from engine.config import EngineConfig
from engine.frontend.engine_main import start_process
from engine.frontend.spare_main import run_spare
from engine.frontend.zygote import ForkedProcess, Zygote
from engine.messages import SpareReady

logger = logging.getLogger(__name__)

# Seconds after a take before the next spare starts. Its imports take a core for seconds, and
# on a small machine they slow more than the core's share: with 2 cores, the engine loading in
# the spare just taken loaded at half speed (weights 0.8 s instead of 0.4, SmolLM2), priority
# notwithstanding, and its first requests were slower. Past the delay it has loaded.
REFILL_DELAY = 5.0
# With a zygote a spare is a fork that imports nothing: it faults in its heap (a fraction of a
# second of one core) and is ready. The engine in the spare just taken has loaded by then.
ZYGOTE_REFILL_DELAY = 1.0
# After a spare that died before it was ready, the next waits this long (doubling up to MAX).
RETRY_DELAY_MIN, RETRY_DELAY_MAX = 1.0, 60.0
# Seconds a spare told to stop (its pipe closed) has to exit before it is killed.
STOP_GRACE = 2.0

Spare = tuple[BaseProcess | ForkedProcess, Connection]


class SparePool:
    """`size` spare engine processes kept ready; thread-safe."""

    def __init__(
        self,
        size: int,
        heap_bytes: int = 0,
        models: Sequence[EngineConfig] = (),
        refill_delay: float | None = None,
        zygote: Zygote | None = None,
    ) -> None:
        """`heap_bytes`: memory each spare faults in while it waits (engine.heap.prefault;
        start_heap_bytes() says what a model's start writes); `models`: the engines a spare
        may become, whose tokenizers each loads and whose checkpoints each maps ahead;
        `zygote`: where spares are forked from (engine.frontend.zygote), else each is spawned."""
        self.size = size
        self.heap_bytes = heap_bytes
        self.tokenizers = tuple(dict.fromkeys(m.tokenizer or m.model for m in models))
        self.checkpoints = tuple(dict.fromkeys(m.model for m in models))
        if refill_delay is None:
            refill_delay = REFILL_DELAY if zygote is None else ZYGOTE_REFILL_DELAY
        self.refill_delay = refill_delay
        self.zygote = zygote
        self._taken_at = float("-inf")  # time.monotonic() of the last take
        self._ready: deque[Spare] = deque()
        self._starting: BaseProcess | ForkedProcess | None = None
        self._changed = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin filling the pool, in the background (a spare takes seconds to be ready)."""
        if self.size <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._refill, name="engine-spares", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # before multiprocessing's own exit handler, which waits

    def take(self) -> Spare | None:
        """A ready spare (its process and its end of the pipe), now the caller's; None when
        none is ready. Another is started in its place, `refill_delay` seconds later."""
        with self._changed:
            while self._ready:
                process, conn = self._ready.popleft()
                self._changed.notify_all()
                if process.is_alive():
                    self._taken_at = time.monotonic()
                    return process, conn
                conn.close()
                process.join(0)
        return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until `size` spares are ready; False on the timeout or once closed."""
        with self._changed:
            full = self._changed.wait_for(
                lambda: self._closed or len(self._ready) >= self.size, timeout
            )
            return bool(full) and not self._closed

    def ready_pids(self) -> list[int]:
        with self._changed:
            return [process.pid for process, _ in self._ready if process.pid is not None]

    def close(self) -> None:
        """Stop every spare, ready or starting, and the refill; a taken one is not the pool's."""
        with self._changed:
            self._closed = True
            spares, self._ready = list(self._ready), deque()
            starting = self._starting
            self._changed.notify_all()
        for _, conn in spares:
            conn.close()  # the spare reads EOF and exits
        if starting is not None:
            starting.kill()  # importing: it reads its pipe only when done
        for process, _ in spares:
            process.join(STOP_GRACE)
            if process.is_alive():
                process.kill()
                process.join(STOP_GRACE)
        if starting is not None:
            starting.join(STOP_GRACE)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_GRACE)
        atexit.unregister(self.close)

    def _refill(self) -> None:
        delay = RETRY_DELAY_MIN
        while True:
            with self._changed:
                if not self._wait_for_room():
                    return
            spare = self._start_one()
            with self._changed:
                self._starting = None
                if self._closed:
                    if spare is not None:
                        spare[1].close()
                    return
                if spare is not None:
                    self._ready.append(spare)
                    self._changed.notify_all()
                    logger.info("a spare engine process (pid %s) is ready", spare[0].pid)
                    delay = RETRY_DELAY_MIN
                    continue
                logger.warning("a spare engine process died while starting; next in %.0f s", delay)
                self._changed.wait(delay)
                delay = min(2 * delay, RETRY_DELAY_MAX)

    def _wait_for_room(self) -> bool:
        """(The lock held.) Wait until a spare is missing and the last take is `refill_delay`
        old; False once closed."""
        while not self._closed:
            if len(self._ready) >= self.size:
                self._changed.wait()
                continue
            wait = self._taken_at + self.refill_delay - time.monotonic()
            if wait <= 0:
                return True
            self._changed.wait(wait)
        return False

    def _start_one(self) -> Spare | None:
        """Fork (or spawn) a spare and wait until it is ready; None if it died first (or was
        killed)."""
        context = mp.get_context("spawn")  # as an engine process: no copy of this one's threads
        conn, child = context.Pipe()
        args = (child, self.heap_bytes, self.tokenizers, self.checkpoints)
        process: BaseProcess | ForkedProcess
        if self.zygote is not None:
            # Outside the lock: a fork waits while the zygote still imports, takes must not.
            process = self.zygote.process(run_spare, args, "loragate-spare")
            with self._changed:
                self._starting = process
                if self._closed:
                    process.kill()
        else:
            with self._changed:
                if self._closed:
                    return None
                process = context.Process(
                    target=run_spare, args=args, name="loragate-spare", daemon=True
                )
                self._starting = process
                start_process(process)
        child.close()
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        if not isinstance(message, SpareReady):
            conn.close()
            process.join(STOP_GRACE)
            return None
        return process, conn


def start_heap_bytes(config: EngineConfig) -> int:
    """Heap an engine of `config` writes as it starts, besides its KV pool (mapped, written as
    it fills): its weights in the compute dtype, then as many again for their packed copies
    (kernels.linear.prepack; the plain ones are freed after); at most what a heap keeps freed
    (engine.heap.TRIM_THRESHOLD). None where the weights will be mapped from the weights cache
    (engine.checkpoints.weights_cache), which writes no heap. An estimate from the checkpoint's
    header and config: nothing is loaded."""
    from transformers import AutoConfig

    from engine.checkpoints.weights_cache import cache_for
    from engine.model_runner import resolve_device, resolve_dtype
    from engine.models.llama import parameter_count

    hf_config = AutoConfig.from_pretrained(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    cache = cache_for(config, device)
    if cache is not None and cache.path(Path(config.model), dtype).exists():
        return 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return min(2 * parameter_count(Path(config.model)) * itemsize, heap.TRIM_THRESHOLD)
