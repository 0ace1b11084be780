"""The engine loop's body, the same in both places it runs: a thread of the gateway's process
(engine/frontend/async_engine.py) and an engine process of its own
(engine/frontend/engine_main.py). One message applied, one step run with its failure contained,
the requests a step finished, the facts and stats the gateway reads.

Failure containment: an exception inside a forward pass fails only the requests that cause it
(LLMEngine.step pins it on them); anything else a step raises fails the requests that were
running, frees their blocks, and the loop keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.frontend.facts import EngineFacts
from engine.llm_engine import LLMEngine
from engine.messages import EngineRequest, EngineStats, Inbound, LoadLoRA, UnloadLoRA
from engine.outputs import SequenceUpdate

logger = logging.getLogger(__name__)


def engine_facts(engine: LLMEngine) -> EngineFacts:
    return EngineFacts(
        engine.tokenizer,
        engine.vocab_size,
        engine.max_model_len,
        tuple(sorted(engine.eos_token_ids)),
    )


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
        num_yielded_steps=engine.num_yielded_steps,
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


def apply_message(
    engine: LLMEngine,
    message: Inbound,
    received_at: float,
    refuse: Callable[[str, BaseException], None],
) -> None:
    """One message, applied on the loop; `received_at`: when the loop's side received it
    (time.monotonic()), a request's arrival; `refuse(request_id, exc)` reports a request
    the engine would not take."""
    if isinstance(message, EngineRequest):
        try:
            engine.add(message, received_at)
        except Exception as exc:  # noqa: BLE001 - refused requests report to their caller
            refuse(message.request_id, exc)
    elif isinstance(message, UnloadLoRA):
        if engine.lora is not None:
            engine.lora.unload(message.adapter_id)
    elif isinstance(message, LoadLoRA):
        engine.load_lora(message.lora)
    else:
        engine.abort(message.request_id)  # a no-op for a request that has finished
