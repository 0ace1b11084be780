"""A warm spare's main (engine/frontend/warm_spare.py): import what an engine needs, at idle
priority, say so, then wait on the pipe to become an engine.

This module imports nothing heavy at its top: a spawned process imports its target's module
before the target runs, and here the imports are the work to do in the background. They run
on a thread of idle priority (SCHED_IDLE, else nice 19; Linux sets these per thread), so
that a spare started while an engine loads or serves takes only CPU nobody else wants; the
engine then runs on the main thread, at the priority it was spawned with, and every thread
it starts inherits that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any


def run_spare(
    conn: Connection,
    heap_bytes: int = 0,
    tokenizers: Sequence[str] = (),
    checkpoints: Sequence[str] = (),
) -> None:
    """Warm up, load the `tokenizers` and map the `checkpoints` (directories) of the models it
    may become, fault in `heap_bytes` of heap, say SpareReady, and wait for a StartEngine (then
    be that engine, as engine_main.run_engine) or for the pipe to close (then exit)."""
    # The gateway decides when this process stops: its pipe closes, or it is killed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    loaded: dict[str, Any] = {}
    warm = threading.Thread(
        target=_warm_up, args=(tokenizers, checkpoints, loaded), name="spare-imports"
    )
    warm.start()
    warm.join()
    from engine import heap

    # On this thread, the engine's: glibc gives each thread its own heap.
    heap.prefault(heap_bytes)

    from engine.frontend.engine_main import run_engine
    from engine.messages import SpareReady, StartEngine

    try:
        conn.send(SpareReady())
        start = conn.recv()
    except (EOFError, OSError):
        return  # the pool closed, or the gateway is gone
    if isinstance(start, StartEngine):
        config = start.config
        tokenizer = loaded.get(config.tokenizer or config.model)
        run_engine(conn, config, start.lora_loader, start.preload, start.handed_at, tokenizer)


def _warm_up(tokenizers: Sequence[str], checkpoints: Sequence[str], loaded: dict[str, Any]) -> None:
    _lower_priority()
    import torch

    # transformers resolves a model's config and tokenizer classes on first use, by name:
    # the Llama family's (engine.models.llama's architectures) ahead.
    import transformers.models.llama.configuration_llama  # noqa: F401
    import transformers.tokenization_utils_fast  # noqa: F401

    import engine.frontend.engine_main  # noqa: F401 - the engine: torch, transformers, the model
    from kernels import native

    # The C++ kernels depend on the machine, not the model, and run on the CPU only.
    if not torch.cuda.is_available():
        native.load()
    # A model's tokenizer takes a fifth of a second to load (transformers parses its JSON in
    # Python), as long as the rest of a spare's cold start, and a checkpoint's first read a
    # fault per few pages: the candidates' ahead, by path (engine.checkpoints.checkpoint_map).
    from transformers import AutoTokenizer

    from engine.checkpoints import checkpoint_map

    zygote = sys.modules.get("engine.frontend.zygote_warm")  # forked from a zygote: loaded there
    for path in tokenizers:
        with contextlib.suppress(Exception):  # the engine loads it, or says what is wrong
            preloaded = None if zygote is None else zygote.preloaded_tokenizer(path)
            loaded[path] = preloaded or AutoTokenizer.from_pretrained(path)
    for path in checkpoints:
        with contextlib.suppress(Exception):
            checkpoint_map.premap(path)


def _lower_priority() -> None:
    """This thread, and only it, at idle priority (Linux: per thread)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
