"""A step of worse-band rows gives way to a better band's request that arrives mid-pass
(engine/give_way.py): the pass stops between layers and is suspended (its half-written KV
withdrawn from the prefix cache), interim steps run the better band's prompts alone, and the
pass resumes where it stopped. Every request's greedy tokens are the same as in a run where
no step gave way, no token is computed twice, no block is leaked, and an abort of a suspended
row waits for the pass's end. Both loops that feed an engine note what they are sent before
they queue it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from multiprocessing import Pipe
from pathlib import Path

import pytest

from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.engine_main import _EngineLoop
from engine.frontend.loop import engine_stats
from engine.give_way import NONE_PENDING, Arrivals, give_way_check
from engine.messages import EngineRequest
from engine.scheduler import SchedulerOutput

BATCH = 100
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
# Two batch lines share a 40-token prefix (prefix-cache hits within one step), a third differs;
# the chat shares it too (a system prompt), so its first step, which runs alone right after a
# step that gave way, would read that step's half-written blocks if they stayed published.
SHARED = [(7 * i) % 90 + 5 for i in range(40)]
BATCH_PROMPTS = {"b0": SHARED + [11, 12], "b1": SHARED + [13, 14], "b2": list(range(20, 70))}
CHAT_PROMPT = SHARED + [9, 8, 7]


def test_the_check_asks_for_a_better_band_than_the_steps_worst() -> None:
    arrivals = Arrivals()
    assert give_way_check(arrivals, []) is None
    check = give_way_check(arrivals, [0, BATCH])
    assert check is not None and not check()
    arrivals.note(BATCH)
    assert not check()  # the step's worst band: nothing to give way to
    arrivals.note(0)
    assert check() and arrivals.best == 0
    arrivals.note(50)
    assert arrivals.best == 0  # the best noted stays
    arrivals.clear()
    assert not check() and arrivals.best == NONE_PENDING
    only_chat = give_way_check(arrivals, [0, 0])
    assert only_chat is not None
    arrivals.note(0)
    assert not only_chat()


def _engine(
    model: Path, policy: str = "fair", step_yield: bool = True, num_kv_blocks: int = 96
) -> LLMEngine:
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=num_kv_blocks,
        max_model_len=min(256, num_kv_blocks * 16),
        dtype="float32",
        scheduling_policy=policy,
        priority_step_yield=step_yield,
    )
    return LLMEngine(config)


def _count_batch_computed(engine: LLMEngine) -> list[int]:
    """The batch lines' tokens every forward pass of the engine's computes, in one total."""
    computed = [0]
    execute = engine.runner.execute

    def counting(sched: SchedulerOutput, *args: object) -> object:
        computed[0] += sum(n for r, n in sched.scheduled if r.request_id in BATCH_PROMPTS)
        return execute(sched, *args)  # type: ignore[arg-type]

    engine.runner.execute = counting  # type: ignore[method-assign,assignment]
    return computed


def _run(engine: LLMEngine, chat_at: int, notes: set[int]) -> dict[str, list[int]]:
    """The three batch lines, and a chat request taken in after step `chat_at`; before each
    step of `notes` an arrival of band 0 is noted (as the loop's inbox thread notes one that
    comes mid-step). Every request's tokens."""
    for request_id, prompt in BATCH_PROMPTS.items():
        engine.add(EngineRequest(request_id, prompt, GREEDY, priority=BATCH))
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in notes:
            engine.arrivals.note(0)
        for update in engine.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
        engine.arrivals.clear()  # what the loop does as it takes in what was sent
        if step == chat_at:
            engine.add(EngineRequest("chat", CHAT_PROMPT, GREEDY))
        step += 1
    return tokens


# Step 0 holds the batch's prompts (two of them hitting blocks the step was to write), the
# steps after it their decode rows. The step after the chat comes is its prompt's alone (the
# batch's rows wait it out), so a note then stops nothing; the chat's decode rows beside the
# batch's give way with them.
@pytest.mark.parametrize(
    ("chat_at", "notes", "yielded"), [(0, {0}, 1), (0, {0, 1}, 1), (2, {2, 3, 5}, 2)]
)
def test_a_step_that_gives_way_changes_no_token_and_leaks_no_block(
    demo_model_dir: Path, chat_at: int, notes: set[int], yielded: int
) -> None:
    reference = _engine(demo_model_dir)
    reference_computed = _count_batch_computed(reference)
    expected = _run(reference, chat_at, set())
    assert reference.num_yielded_steps == 0
    engine = _engine(demo_model_dir)
    computed = _count_batch_computed(engine)
    assert _run(engine, chat_at, notes) == expected
    assert engine.num_yielded_steps == yielded
    assert engine_stats(engine).num_yielded_steps == yielded  # what /metrics reads
    # Resumed, not recomputed: none of the batch's work thrown away, nobody preempted. (The
    # chat may compute more: the blocks the suspended pass writes are not there to hit.)
    assert computed == reference_computed
    assert engine.scheduler.num_preemptions == 0
    kv = engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_a_prompt_that_needs_the_suspended_rows_blocks_has_the_pass_rolled_back(
    demo_model_dir: Path,
) -> None:
    # Ten blocks: the batch's prompts take eight, the chat's needs three (the shared prefix's
    # blocks are withheld while the pass is suspended). Rather than wait for the pass, the
    # chat has it rolled back, and the next step preempts a batch line for it.
    reference = _engine(demo_model_dir, num_kv_blocks=10)
    expected = _run(reference, 0, set())
    engine = _engine(demo_model_dir, num_kv_blocks=10)
    assert _run(engine, 0, {0}) == expected
    assert engine.num_yielded_steps == engine.num_rolled_back_steps == 1
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_an_abort_of_a_suspended_row_waits_for_the_passs_end(demo_model_dir: Path) -> None:
    reference = _engine(demo_model_dir)
    for request_id in ("b1", "b2"):
        reference.add(EngineRequest(request_id, BATCH_PROMPTS[request_id], GREEDY, priority=BATCH))
    reference.add(EngineRequest("chat", CHAT_PROMPT, GREEDY))
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        for update in reference.step():
            expected.setdefault(update.request_id, []).extend(update.new_token_ids)

    engine = _engine(demo_model_dir)
    for request_id, prompt in BATCH_PROMPTS.items():
        engine.add(EngineRequest(request_id, prompt, GREEDY, priority=BATCH))
    engine.arrivals.note(0)
    assert engine.step() == [] and engine.num_yielded_steps == 1  # the batch's prompts wait
    engine.arrivals.clear()
    engine.abort("b0")  # the client went away while its row's pass waits
    held = engine.kv.block_ids("b0")
    engine.add(EngineRequest("chat", CHAT_PROMPT, GREEDY))
    interim = engine.step()  # the chat's prompt alone, in blocks of its own
    assert [u.request_id for u in interim] == ["chat"]
    assert not set(engine.kv.block_ids("chat")) & set(held)
    tokens: dict[str, list[int]] = {}
    for update in interim:
        tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert {k: v for k, v in tokens.items() if k != "b0"} == expected
    assert "b0" not in engine.parents and "b0" not in engine.sequences
    # b0's blocks went back when the pass ended; none is leaked.
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_a_step_of_the_arrivals_own_band_does_not_give_way(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    engine.add(EngineRequest("chat", CHAT_PROMPT, GREEDY))
    while engine.has_unfinished_requests():
        engine.arrivals.note(0)
        engine.step()
    assert engine.num_yielded_steps == 0


@pytest.mark.parametrize(("policy", "step_yield"), [("fcfs", True), ("fair", False)])
def test_policy_fcfs_or_the_switch_off_never_gives_way(
    demo_model_dir: Path, policy: str, step_yield: bool
) -> None:
    engine = _engine(demo_model_dir, policy, step_yield)
    engine.add(EngineRequest("b0", BATCH_PROMPTS["b0"], GREEDY, priority=BATCH))
    engine.arrivals.note(0)
    engine.step()
    assert engine.num_yielded_steps == 0


def test_the_thread_loop_notes_a_request_as_it_queues_it(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    client = AsyncEngine(engine)  # not started: the message stays queued
    client._submit(EngineRequest("b0", [5, 6], GREEDY, priority=BATCH))
    assert engine.arrivals.best == BATCH
    client._submit(EngineRequest("chat", [5, 6], GREEDY))
    assert engine.arrivals.best == 0


def test_the_process_loops_inbox_thread_notes_a_request_off_the_pipe(
    demo_model_dir: Path,
) -> None:
    engine = _engine(demo_model_dir)
    ours, theirs = Pipe()
    loop = _EngineLoop(engine, theirs)
    reader = threading.Thread(target=loop._read, daemon=True)
    reader.start()
    sent = time.monotonic()
    ours.send(EngineRequest("chat", [5, 6], GREEDY))
    deadline = time.monotonic() + 10
    while engine.arrivals.best != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.arrivals.best == 0
    ours.close()  # the pipe's end reads as the stop message
    reader.join(10)
    assert not reader.is_alive()
    item = loop._inbox.get(timeout=1)
    assert item is not None
    message, received_at = item
    assert message.request_id == "chat"
    assert sent <= received_at <= time.monotonic()  # its arrival, before any step takes it in
    assert loop._inbox.get(timeout=1) is None


def test_a_requests_queue_time_counts_from_its_receipt_not_its_intake(
    demo_model_dir: Path,
) -> None:
    """A request that came while a step ran is taken in when the step ends (or gives way):
    its queue time, which /metrics shows as loragate:request_queue_time_seconds, counts
    that wait too."""
    engine = _engine(demo_model_dir)
    received_at = time.monotonic() - 5.0  # as if a step of five seconds had been under way
    engine.add(EngineRequest("late", [5, 6, 7], GREEDY), received_at)
    engine.add(EngineRequest("now", [5, 6, 8], GREEDY))
    firsts = {}
    while engine.has_unfinished_requests():
        for update in engine.step():
            firsts.setdefault(update.request_id, update.queue_time)
    assert firsts["late"] >= 5.0
    assert firsts["now"] < 5.0


def test_an_adapter_load_waits_for_the_suspended_passs_end(
    demo_model_dir: Path, demo_adapter: Callable[..., Path]
) -> None:
    # A load may move the resident adapters in the pool (compaction), under the offsets the
    # suspended pass's adapted rows hold: it waits for the pass to end.
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    first = registry.register("first", demo_adapter(8, seed=31))
    second = registry.register("second", demo_adapter(16, seed=32))
    batch = [("b0", BATCH_PROMPTS["b0"], first), ("b2", BATCH_PROMPTS["b2"], None)]

    def run(load_while_suspended: bool) -> tuple[LLMEngine, dict[str, list[int]]]:
        config = EngineConfig(
            model=str(demo_model_dir), num_kv_blocks=96, max_model_len=256, dtype="float32"
        )
        engine = LLMEngine(config, lora_loader=registry.loader)
        engine.load_lora(first)  # resident, so that b0's rows are in the pass that gives way
        for request_id, prompt, lora in batch:
            engine.add(EngineRequest(request_id, prompt, GREEDY, lora=lora, priority=BATCH))
        tokens: dict[str, list[int]] = {}
        if load_while_suspended:
            engine.arrivals.note(0)
            assert engine.step() == [] and engine.num_yielded_steps == 1
            engine.arrivals.clear()
            assert engine._suspended is not None
            assert {r.request_id for r in engine._suspended.rows} == {"b0", "b2"}
            engine.load_lora(second)
            assert engine.lora is not None and second.adapter_id not in engine.lora.slot_of
        while engine.has_unfinished_requests():
            for update in engine.step():
                tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
        return engine, tokens

    _, expected = run(load_while_suspended=False)
    engine, tokens = run(load_while_suspended=True)
    assert tokens == expected
    assert engine.lora is not None and second.adapter_id in engine.lora.slot_of
