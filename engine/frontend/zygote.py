"""The zygote: one process per gateway (or per `loragate engine` host) that has imported torch,
transformers and the engine once, and forks a child for each engine start.

Most of a cold start was the new process's own: an interpreter importing torch and the
engine, 5-9 s on a small machine (docs: Several models, Cold start). The zygote pays that once.
It is multiprocessing's forkserver, preloaded with engine/frontend/zygote_warm.py: a fork of a
process with torch imported takes milliseconds, and the child then loads the model's weights,
which it alone holds. Chosen over a hand-made `os.fork` server because the forkserver already passes
the child's pipes (SCM_RIGHTS), reports its exit code, and restarts itself when found dead;
and over warm spares because a spare is one process for one start, while the zygote serves any
number of starts at once.

    gateway ── Zygote.process(run_engine, args) ── forkserver (torch imported) ── fork ──▶ engine
                └ watch thread: a dead zygote is started again, in the background

The zygote starts in the background (`start`): a start that comes while it is importing waits
for it, which is never longer than spawning a fresh process would take. Its children are not
the gateway's, so `ForkedProcess` watches one by a pidfd: an engine stays alive to the gateway
when its zygote dies (the forkserver's own record of it would say exit code 255).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from typing import Any

from engine.frontend.engine_main import environ, environ_lock, omp_wait_settings

logger = logging.getLogger(__name__)

WARM_MODULE = "engine.frontend.zygote_warm"
# The models a zygote may start, os.pathsep-separated: set for the zygote as it starts.
MODELS_ENV = "LORAGATE_ZYGOTE_MODELS"
WATCH_INTERVAL = 1.0  # seconds between looks at whether the zygote is alive


class ForkedProcess:
    """A child of the zygote, as the gateway sees it: the subset of multiprocessing's Process
    that EngineProcess uses, with liveness from a pidfd (Linux 5.3+; elsewhere the
    forkserver's record)."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process
        assert process.pid is not None
        self.pid: int = process.pid
        self._pidfd: int | None = None
        self._gone = False
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(self.pid)

    def _exited(self, timeout: float | None) -> bool:
        if self._gone:
            return True
        if self._pidfd is None:
            self._process.join(timeout)
            self._gone = not self._process.is_alive()
        else:
            self._gone = bool(select.select([self._pidfd], [], [], timeout)[0])
        if self._gone:
            self._process.join(0)  # the exit code, where the zygote still reports it
            self._close()
        return self._gone

    def is_alive(self) -> bool:
        return not self._exited(0)

    def join(self, timeout: float | None = None) -> None:
        self._exited(timeout)

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else self._process.exitcode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self._exited(0):
            return
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is None:
                os.kill(self.pid, sig)
            else:
                signal.pidfd_send_signal(self._pidfd, sig)

    def _close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        self._close()


class Zygote:
    """The forkserver this process's engines start from; thread-safe."""

    def __init__(self, models: Sequence[str] = ()) -> None:
        """`models`: directories of the models (and tokenizers) its children may load: their
        tokenizers are loaded and checkpoints mapped in the zygote, ahead."""
        self.models = tuple(dict.fromkeys(str(m) for m in models))
        self._context = mp.get_context("forkserver")
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None
        self.starts = 0  # zygotes started (a restart after a death counts)

    @property
    def pid(self) -> int | None:
        """The zygote's process id, while one was started (it may have died since)."""
        server: Any = forkserver._forkserver
        pid: int | None = server._forkserver_pid
        return pid

    def start(self) -> None:
        """Start the zygote (it imports in the background) and the thread that restarts it."""
        self._ensure_running()
        if self._watch is None:
            self._watch = threading.Thread(target=self._keep_alive, name="zygote", daemon=True)
            self._watch.start()

    def process(
        self, target: Callable[..., Any], args: tuple[Any, ...], name: str
    ) -> ForkedProcess:
        """A child forked from the zygote running target(*args), started (the zygote started
        first if it is not running)."""
        self._ensure_running()
        process = self._context.Process(target=target, args=args, name=name, daemon=True)
        process.start()
        return ForkedProcess(process)

    def close(self) -> None:
        """Stop watching; the zygote exits once no process holds its alive pipe (this one and
        its children: running engines keep it)."""
        self._closed.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(WATCH_INTERVAL * 2)

    def _ensure_running(self) -> None:
        server: Any = forkserver._forkserver
        with self._lock:
            before = server._forkserver_pid
            alive = before is not None and os.waitpid(before, os.WNOHANG)[0] == 0
            if alive:
                return
            if before is not None:
                # waitpid reaped it: the forkserver's own check must see it gone too.
                server._forkserver_pid = None
                with contextlib.suppress(OSError):
                    os.close(server._forkserver_alive_fd)
                server._forkserver_alive_fd = None
                server._forkserver_address = None
                logger.warning("the zygote (pid %s) died; starting another", before)
            # '__main__' too: a child then need not import the gateway's main module again.
            self._context.set_forkserver_preload(["__main__", WARM_MODULE])
            # The zygote imports torch: its OpenMP reads these then, and every fork has them.
            models = {MODELS_ENV: os.pathsep.join(self.models)} if self.models else {}
            with environ_lock, environ(**omp_wait_settings(), **models):
                server.ensure_running()
            self.starts += 1
            logger.info("zygote started (pid %s), importing the engine", server._forkserver_pid)

    def _keep_alive(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL):
            try:
                self._ensure_running()
            except Exception:  # noqa: BLE001 - tried again at the next look
                logger.exception("the zygote could not be started")
                time.sleep(WATCH_INTERVAL)
