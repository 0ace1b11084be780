"""Fair under saturation: short steps while a key below its share is present, its prefill
first, its bursts given slots, its decode never preempted for a more served key, and the
flooding key never starved. Decisions are checked exactly on constructed queues, with a
pinned step cost and a clock the test moves."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest
from fair_scheduling import add, finish_done, make_scheduler, run_step

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.fairness import LINGER, FairQueue
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.client import EngineClient
from engine.frontend.engine_process import EngineProcess
from engine.messages import EngineRequest
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import SpeculativeConfig
from engine.step_cost import MIN_STEPS, StepCost


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# 2 ms a step plus 0.5 ms a token: a 40-token prompt's step takes 22 ms.
COST = StepCost(fixed=0.002, per_token=0.0005)


def scheduler(
    clock: Clock, num_blocks: int = 200, budget: int = 64, max_seqs: int = 4
) -> Scheduler:
    return make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        budget=budget,
        max_seqs=max_seqs,
        step_cost=COST,
        clock=clock,
    )


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def prefill_of(out: SchedulerOutput, key: str) -> int:
    """Prompt tokens the key's rows compute in the step (decode rows are 1 token)."""
    return sum(n for r, n in out.scheduled if r.fairness_key == key and n > 1)


# -- the step cap -------------------------------------------------------------------------------


def test_the_cap_engages_only_while_a_key_below_its_share_is_present() -> None:
    clock = Clock()
    sched = scheduler(clock)
    add(sched, "a0", 400, key="A")
    # A alone: nobody is below a share, each step is the whole budget.
    for _ in range(3):
        out = sched.schedule()
        assert out.prefill_cap is None and plan(out) == [("a0", 64)]
        run_step(out)
    b0 = add(sched, "b0", 40, key="B", first=5000, max_tokens=3)
    # B waits, below its share: A's prompt chunk yields the step to B's prompt.
    out = sched.schedule()
    assert out.prefill_cap == 0 and plan(out) == [("b0", 40)]
    run_step(out)
    # B decodes. Half B's own first step (22 ms) is 11 ms: 17 prompt tokens beside B's decode
    # row. But A's decode must stay fed: a 400-token prompt per 16 outputs (none finished
    # yet) for the 3 slots B leaves is 75 tokens a step, twice that with the margin.
    for _ in range(2):
        out = sched.schedule()
        assert out.prefill_cap == 150 and plan(out) == [("a0", 63), ("b0", 1)]
        finish_done(sched, run_step(out))
    assert b0.is_finished
    # B has gone, but could come back: the cap stays LINGER seconds (A may have 4 slots
    # now: 200 tokens, more than the budget), then releases.
    out = sched.schedule()
    assert out.prefill_cap == 200 and plan(out) == [("a0", 64)]
    run_step(out)
    clock.now += LINGER
    add(sched, "a1", 100, key="A", first=7000)
    out = sched.schedule()
    assert out.prefill_cap is None and plan(out) == [("a0", 18), ("a1", 46)]


def test_a_light_prompt_that_cannot_get_its_blocks_holds_nobody_back() -> None:
    clock = Clock()
    sched = scheduler(clock, num_blocks=30)  # 120 tokens of KV
    add(sched, "a0", 100, key="A")
    run_step(sched.schedule())  # a0 holds 16 blocks; 14 are free: 56 tokens
    add(sched, "b0", 60, key="B", first=5000)
    # b0 would need 15 blocks: a0's prompt goes on (it may be what frees them).
    out = sched.schedule()
    assert out.prefill_cap != 0 and plan(out)[0][0] == "a0"


def test_the_step_is_kept_within_the_delay_ratio_when_the_flood_needs_less() -> None:
    clock = Clock()
    sched = scheduler(clock)
    a0 = add(sched, "a0", 16, key="A", max_tokens=64)
    while not a0.is_finished:  # A's history: 16-token prompts, 64-token outputs
        finish_done(sched, run_step(sched.schedule()))
    add(sched, "a1", 300, key="A", first=1000)
    for _ in range(3):
        run_step(sched.schedule())
    add(sched, "b0", 40, key="B", first=5000, max_tokens=3)
    run_step(sched.schedule())
    # A needs 3 slots x (87 / 64) = 4 prompt tokens a step, 8 with the margin (its typical
    # prompt is 87 now): the time bound, 17 tokens, is the cap.
    out = sched.schedule()
    assert out.prefill_cap == 17 and plan(out) == [("a1", 17), ("b0", 1)]


def test_the_cap_stays_off_between_keys_served_alike() -> None:
    clock = Clock()
    sched = scheduler(clock, max_seqs=8, budget=32)
    for i in range(8):
        add(sched, f"a{i}", 24, key="A", first=100 * i, max_tokens=6)
        add(sched, f"b{i}", 24, key="B", first=5000 + 100 * i, max_tokens=6)
    caps = []
    for _ in range(40):
        out = sched.schedule()
        caps.append(out.prefill_cap)
        finish_done(sched, run_step(out))
        clock.now += 0.01
    # The first steps serve A first (the older head), then B's turn is due; after that the
    # two are served alike and nothing is capped.
    assert all(cap is None for cap in caps[4:])


def test_without_measured_steps_only_the_below_share_prefill_turn_is_kept() -> None:
    clock = Clock()
    sched = make_scheduler(budget=64, max_seqs=4, clock=clock)  # a StepCost that learned nothing
    add(sched, "a0", 200, key="A")
    run_step(sched.schedule())
    add(sched, "b0", 8, key="B", first=5000)
    out = sched.schedule()
    assert out.prefill_cap == 0 and plan(out) == [("b0", 8)]
    run_step(out)
    out = sched.schedule()
    assert out.prefill_cap is None and plan(out) == [("a0", 63), ("b0", 1)]


def test_a_below_share_request_gets_its_first_token_in_its_first_step_under_a_flood() -> None:
    clock = Clock()
    sched = scheduler(clock)
    computed: Counter[str | None] = Counter()
    finished_a: Counter[int] = Counter()
    first_token_steps = []
    b_requests: list[tuple[int, Request]] = []
    num_a = 0
    for step in range(300):
        while sum(r.fairness_key == "A" for r in sched.waiting) < 8:  # A never runs dry
            add(sched, f"a{num_a}", 90, key="A", first=100 * num_a, max_tokens=8)
            num_a += 1
        if step % 15 == 5:
            b = add(sched, f"b{step}", 12, key="B", first=9000 + step, max_tokens=4)
            b_requests.append((step, b))
        out = sched.schedule()
        for request, num_new in out.scheduled:
            computed[request.fairness_key] += num_new
        sampled = run_step(out)
        for arrived, request in b_requests:
            if request in sampled and request.num_output_tokens == 1:
                first_token_steps.append(step - arrived)
        finish_done(sched, sampled)
        finished_a[step // 50] += sum(r.is_finished and r.fairness_key == "A" for r in sampled)
        clock.now += COST.predict(out.num_batched_tokens)
    assert len(first_token_steps) == len(b_requests) == 20
    assert set(first_token_steps) == {0}
    # The flood is not starved: A computed most of the tokens and finished requests in every
    # window of 50 steps.
    assert computed["A"] > 3 * computed["B"]
    assert all(finished_a[w] > 0 for w in range(6)), finished_a


# -- slots and preemption -----------------------------------------------------------------------


def test_a_light_keys_burst_takes_slots_beyond_its_count_share() -> None:
    clock = Clock()
    sched = scheduler(clock)
    for i in range(10):
        add(sched, f"a{i}", 8, key="A", first=100 * i, max_tokens=200)
    for _ in range(60):  # A has been served alone for a while
        run_step(sched.schedule())
        clock.now += 0.01
    for i in range(3):
        add(sched, f"b{i}", 8, key="B", first=5000 + 100 * i, max_tokens=200)
    for _ in range(3):
        run_step(sched.schedule())
        clock.now += 0.01
    # B's share of 4 slots is 2 by count, but B has had a fraction of A's service: its burst
    # runs as if alone, and A keeps one slot.
    assert Counter(r.fairness_key for r in sched.running) == {"B": 3, "A": 1}
    assert sched.num_fairness_preemptions == 3
    # A, more served, takes nothing back from B while B stays below its share.
    for _ in range(20):
        run_step(sched.schedule())
        clock.now += 0.01
    assert sched.waiting.favour().keys == {"B"}
    assert sched.num_fairness_preemptions == 3


def test_a_below_share_keys_decode_is_never_preempted_for_a_more_served_keys_work() -> None:
    clock = Clock()
    # 7 blocks of 4 tokens.
    sched = scheduler(clock, num_blocks=7, budget=16)
    a0 = add(sched, "a0", 16, key="A")
    run_step(sched.schedule())  # a0: 4 blocks and its first token
    b0 = add(sched, "b0", 7, key="B", first=5000)  # B back from idle: A's counter, newest
    a1 = add(sched, "a1", 4, key="A", first=6000)
    out = sched.schedule()
    assert plan(out) == [("a0", 1), ("b0", 7)]
    run_step(out)
    assert sched.waiting.counter("B") > sched.waiting.counter("A")
    # Every block is taken (a0 5, b0 2); a0 needs a sixth after its next tokens. By counter
    # alone B's b0 (the newest request of the most served key) would go; but B has had less
    # than half A's recent service: it is below its share.
    a0.all_token_ids.extend([7, 7, 7])
    out = sched.schedule()
    assert out.preempted == [a0] and b0 in sched.running and a1 not in sched.running
    assert sched.preemption_victim(b0) is b0  # for B's own need, B's own request


def test_fcfs_has_no_cap_and_no_protection() -> None:
    clock = Clock()
    sched = make_scheduler("fcfs", budget=64, max_seqs=4, step_cost=COST, clock=clock)
    add(sched, "a0", 100, key="A")
    run_step(sched.schedule())
    add(sched, "b0", 8, key="B", first=5000)
    out = sched.schedule()
    assert out.prefill_cap is None and plan(out) == [("a0", 36), ("b0", 8)]
    assert FairQueue(use_keys=False).below_share() == frozenset()


# -- the step cost ------------------------------------------------------------------------------


def test_the_step_cost_fits_a_line_to_measured_steps() -> None:
    cost = StepCost()
    for i in range(MIN_STEPS - 1):
        cost.observe(10 + 20 * i, 0.004 + 0.0002 * (10 + 20 * i))
    assert not cost.fitted
    cost.observe(300, 0.004 + 0.0002 * 300)
    assert cost.fitted
    assert cost.fixed == pytest.approx(0.004) and cost.per_token == pytest.approx(0.0002)
    assert cost.predict(50) == pytest.approx(0.014) and cost.marginal_tokens(0.003) == 15


def test_steps_of_one_size_show_no_slope_and_fit_nothing() -> None:
    cost = StepCost()
    for _ in range(50):
        cost.observe(8, 0.01)
    assert not cost.fitted
    cost.observe(72, 0.026)
    assert cost.fitted and cost.per_token == pytest.approx(0.00025, rel=0.05)


# -- the engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [False, True])
def test_the_engine_steps_a_light_tenants_prompt_first_under_a_flood(
    demo_model_dir: Path, speculative: bool
) -> None:
    """The same scheduler under LLMEngine.step (the engine process, `loragate engine` and the
    in-process loop all run it), with n-gram speculation on and off: B's first token comes
    in the step after its request, while A's long prompts keep arriving."""
    core = LLMEngine(
        EngineConfig(
            model=str(demo_model_dir),
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            num_kv_blocks=200,
            dtype="float32",
            speculative_config=(
                SpeculativeConfig(
                    num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1
                )
                if speculative
                else None
            ),
        )
    )
    a_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    b_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # A token repeated, another for each request (no prefix-cache hits): the demo model's
    # greedy output often repeats itself after such a prompt, and n-grams draft from that.
    rng = random.Random(5)
    first_token_steps = []
    served: Counter[str] = Counter()
    pending: dict[str, int] = {}
    for step in range(160):
        if step % 3 == 0:
            a_prompt = [rng.randrange(10, 4000)] * 400
            core.add(EngineRequest(f"a{step}", a_prompt, a_params, fairness_key="A"))
        if step % 20 == 10:
            core.add(EngineRequest(f"b{step}", [30 + step % 50] * 10, b_params, fairness_key="B"))
            pending[f"b{step}"] = step
        for update in core.step():
            served[update.request_id[0]] += len(update.new_token_ids)
            if update.request_id in pending and update.new_token_ids:
                first_token_steps.append(step - pending.pop(update.request_id))
    assert len(first_token_steps) == 8 and max(first_token_steps) <= 1
    assert served["a"] > served["b"] > 0
    if speculative:
        assert core.num_drafts > 0


async def a_first_tokens_before_b(client: EngineClient) -> int:
    """A floods with long prompts; once A has its first token, B sends a short one. How many
    of A's requests got their first token between B's request and B's first token."""
    client.start()
    a_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first_tokens: list[str] = []  # request ids in the order their first token arrived

    async def run(request: EngineRequest) -> None:
        async for update in client.generate(request):
            if update.new_token_ids and request.request_id not in first_tokens:
                first_tokens.append(request.request_id)
                return

    a_tasks = [
        asyncio.create_task(
            run(EngineRequest(f"a{i}", [1000 + i] * 400, a_params, fairness_key="A"))
        )
        for i in range(12)
    ]
    while not first_tokens:
        await asyncio.sleep(0.005)
    b_sent_at = len(first_tokens)
    b = EngineRequest("b", [30] * 10, SamplingParams(temperature=0, max_tokens=2), None, "B")
    await run(b)
    await asyncio.gather(*a_tasks)
    await client.shutdown(0)
    return first_tokens.index("b") - b_sent_at


FLOOD_CONFIG = {
    "max_model_len": 512,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    "num_kv_blocks": 200,
    "num_threads": 1,
    "dtype": "float32",
}


async def test_the_engine_process_and_the_in_process_loop_agree(demo_model_dir: Path) -> None:
    def config(policy: str) -> EngineConfig:
        return EngineConfig(
            model=str(demo_model_dir),
            scheduling_policy=policy,
            **FLOOD_CONFIG,  # type: ignore[arg-type]
        )

    in_process = await a_first_tokens_before_b(AsyncEngine(LLMEngine(config("fair"))))
    own_process = await a_first_tokens_before_b(EngineProcess(config("fair")))
    fcfs = await a_first_tokens_before_b(AsyncEngine(LLMEngine(config("fcfs"))))
    # Under fair, B's prompt has the next step: at most the A prompt finishing in the step
    # under way goes first. Under fcfs B waits for A's queue.
    assert in_process <= 1 and own_process <= 1
    assert fcfs >= 6
