"""Priority bands (engine/priority.py): lower priority runs first, a worse band fills what the
better one leaves and gives way first, fairness within a band, and the starvation bound."""

from __future__ import annotations

from pathlib import Path

import pytest
from fair_scheduling import add, admitted, finish_done, ids, make_scheduler, run_step

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import RequestRefused
from engine.messages import EngineRequest

BATCH = 100


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("policy", ["fair", "priority"])
def test_a_better_band_is_admitted_first_whatever_came_earlier(policy: str) -> None:
    sched = make_scheduler(policy, max_seqs=2)
    for i in range(3):
        add(sched, f"batch{i}", 4, key="A", first=10 * i, priority=BATCH)
    add(sched, "chat", 4, key="B", first=500)
    # The chat's prompt has the step to itself (a worse band's prompt never delays a better
    # band's first token); the batch's next.
    out = sched.schedule()
    assert admitted(out) == ["chat"]
    run_step(out)
    assert admitted(sched.schedule()) == ["chat", "batch0"]


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler("fcfs", max_seqs=2)
    add(sched, "batch0", 4, key="A", priority=BATCH)
    add(sched, "chat", 4, key="B", first=500)
    assert admitted(sched.schedule()) == ["batch0", "chat"]


def test_a_better_bands_prompt_takes_the_budget_before_a_running_worse_band() -> None:
    sched = make_scheduler("priority", budget=16)
    add(sched, "batch", 64, key="A", priority=BATCH)
    run_step(sched.schedule())  # the batch's first chunk
    add(sched, "chat", 12, key="B", first=500)
    out = sched.schedule()
    # The chat's prompt is planned first, and has the step: the batch's chunk waits.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("chat", 12)]
    assert ids(sched.running) == ["chat", "batch"]
    run_step(out)
    out = sched.schedule()  # the chat decodes; the batch's chunk fills the rest of the budget
    assert [(r.request_id, n) for r, n in out.scheduled] == [("chat", 1), ("batch", 15)]


def test_with_every_slot_taken_by_a_worse_band_a_better_request_takes_one() -> None:
    sched = make_scheduler("fair", max_seqs=2)
    add(sched, "batch0", 4, key="A", priority=BATCH)
    add(sched, "batch1", 4, key="A", first=100, priority=BATCH)
    run_step(sched.schedule())
    add(sched, "chat", 4, key="B", first=500)
    out = sched.schedule()
    assert "chat" in admitted(out)
    assert ids(sched.running) == ["chat", "batch0"]  # the newest batch request gave way
    assert ids(list(sched.waiting)) == ["batch1"]


def test_with_memory_taken_by_a_worse_band_a_better_request_gets_blocks() -> None:
    # 8 blocks of 4: two batch requests of 15 tokens (16 with their first output) hold all.
    sched = make_scheduler("priority", num_blocks=8, budget=64)
    add(sched, "batch0", 15, key="A", priority=BATCH)
    add(sched, "batch1", 15, key="A", first=100, priority=BATCH)
    run_step(sched.schedule())
    assert sched.kv.num_free_blocks == 0
    add(sched, "chat", 8, key="B", first=500)
    out = sched.schedule()
    assert "chat" in admitted(out)
    assert ids(out.preempted) == ["batch1"]
    assert ids(list(sched.waiting)) == ["batch1"]


def test_a_better_band_is_never_preempted_for_a_worse_bands_blocks() -> None:
    sched = make_scheduler("priority", num_blocks=4, budget=64)
    add(sched, "batch", 7, key="A", first=100, priority=BATCH, max_tokens=100)
    run_step(sched.schedule())  # the batch: 8 tokens in 2 blocks
    add(sched, "chat", 8, key="B", max_tokens=100)
    run_step(sched.schedule())  # the chat's prompt in the other 2; the batch waits
    # Both need a third block now: the chat's is taken from the batch, never the other way.
    out = sched.schedule()
    assert ids(out.preempted) == ["batch"]
    assert ids(sched.running) == ["chat"]


def test_the_best_band_is_favoured_while_a_worse_one_is_present() -> None:
    clock = Clock()
    sched = make_scheduler("fair", clock=clock)
    add(sched, "batch", 4, key="A", priority=BATCH)
    favour = sched.waiting.favour()
    assert not favour  # one band, one key: nobody to protect
    add(sched, "chat", 4, key="A", first=100)
    favour = sched.waiting.favour()
    assert favour.whole and favour.band == 0
    assert sched.running == [] and all((r in favour) == (r.priority == 0) for r in sched.waiting)


def test_a_worse_bands_prompt_yields_the_step_to_a_better_bands_prompt() -> None:
    from engine.step_cost import StepCost

    cost = StepCost()
    for tokens, seconds in ((1, 0.010), (64, 0.030), (256, 0.090), (16, 0.015)) * 3:
        cost.observe(tokens, seconds)
    sched = make_scheduler("fair", budget=64, step_cost=cost)
    add(sched, "batch", 200, key="A", priority=BATCH)
    run_step(sched.schedule())
    add(sched, "chat", 8, key="B", first=500)
    out = sched.schedule()
    assert out.prefill_cap == 0  # the chat's prompt is due: the batch's chunk waits
    assert [(r.request_id, n) for r, n in out.scheduled] == [("chat", 8)]


def test_fairness_holds_within_a_band() -> None:
    sched = make_scheduler("fair", max_seqs=2)
    for i in range(5):
        add(sched, f"a{i}", 4, key="A", first=10 * i, priority=BATCH)
    add(sched, "b0", 4, key="B", first=500, priority=BATCH)
    assert admitted(sched.schedule()) == ["a0", "b0"]


def test_a_starved_band_gets_a_request_in_within_the_bound() -> None:
    clock = Clock()
    sched = make_scheduler("priority", max_seqs=1, clock=clock, max_wait=5.0)
    add(sched, "batch", 4, key="A", priority=BATCH, max_tokens=1)
    n = 0

    def interactive() -> None:
        nonlocal n
        add(sched, f"chat{n}", 4, key="B", first=100 + 10 * n, max_tokens=1)
        n += 1

    interactive()
    interactive()
    started: list[str] = []
    for _ in range(12):  # a better band always waiting: strict order never admits the batch
        out = sched.schedule()
        started += admitted(out)
        finish_done(sched, run_step(out))
        interactive()
        clock.now += 1.0
    assert "batch" in started
    assert started.index("batch") <= 7  # within max_wait (5 s at a step a second) + a step
    assert sched.waiting.num_promotions == 1


def test_the_engine_takes_priority_and_refuses_a_non_integer(demo_model_dir: Path) -> None:
    config = EngineConfig(model=str(demo_model_dir), num_kv_blocks=64, max_model_len=256)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add(EngineRequest("low", [5, 6, 7], params, priority=BATCH))
    engine.add(EngineRequest("high", [5, 6, 8], params))
    first = engine.step()
    assert [u.request_id for u in first][:1] == ["high"]  # planned first
    with pytest.raises(RequestRefused, match="priority"):
        engine.add(EngineRequest("bad", [5], params, priority=1.5))  # type: ignore[arg-type]


def test_a_better_bands_first_step_runs_without_the_worse_bands_rows() -> None:
    sched = make_scheduler("fair", budget=64)
    add(sched, "batch", 4, key="A", priority=BATCH)
    run_step(sched.schedule())  # the batch decodes from here on
    add(sched, "chat", 8, key="B", first=500)
    out = sched.schedule()
    # The chat's first token comes from a step as short as if it were alone; the batch's
    # decode row waits that one step.
    assert [(r.request_id, n) for r, n in out.scheduled] == [("chat", 8)]
    run_step(out)
    assert admitted(sched.schedule()) == ["chat", "batch"]


def test_an_interim_step_runs_only_better_bands_prompts_and_preempts_nobody() -> None:
    # While a step of the batch's and the chat's rows is suspended (engine/give_way.py), the
    # interim step takes in the better band's new prompts alone, past the sequence slots the
    # suspended rows hold but only in free blocks.
    sched = make_scheduler("priority", num_blocks=8, budget=64, max_seqs=2)
    add(sched, "chat", 4, key="B", first=500)
    add(sched, "batch", 11, key="A", priority=BATCH)
    run_step(sched.schedule())  # the chat's prompt alone
    suspended = sched.schedule()
    assert admitted(suspended) == ["chat", "batch"]  # both slots, 5 of the 8 blocks
    add(sched, "late-batch", 4, key="A", first=200, priority=BATCH)
    add(sched, "chat2", 8, key="B", first=600)
    add(sched, "chat3", 8, key="B", first=700)
    interim = sched.schedule_interim(suspended.scheduled, worst=BATCH)
    # chat2 fits the 3 free blocks; chat3 would need the suspended rows' blocks.
    assert [(r.request_id, n) for r, n in interim.scheduled] == [("chat2", 8)]
    assert interim.needs_suspended_blocks
    assert not interim.preempted and sched.num_preemptions == 0
    assert ids(sched.running) == ["chat", "chat2", "batch"]
    assert ids(list(sched.waiting)) == ["chat3", "late-batch"]
    nothing_better = sched.schedule_interim(suspended.scheduled, worst=0)
    assert nothing_better.is_empty and not nothing_better.needs_suspended_blocks
    # After the pass, the worse band gives back the slot it is over by.
    run_step(suspended)
    run_step(interim)
    sched.schedule()
    assert ids(sched.running) == ["chat", "chat2"]
