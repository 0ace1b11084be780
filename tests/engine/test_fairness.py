"""Fair scheduling (VTC): admission order across fairness keys, weights, counter lift on
return from idle, the preemption victim, and FCFS where there is nothing to be fair about."""

from __future__ import annotations

import pickle
import random
from collections import Counter
from pathlib import Path

import pytest
from fair_scheduling import add, admitted, finish_done, ids, make_scheduler, run_step

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.fairness import DECODE_TOKEN_COST, PREFILL_TOKEN_COST
from engine.frontend.async_engine import AsyncEngine
from engine.messages import EngineRequest
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput

# -- admission order ----------------------------------------------------------------------------


def test_a_light_key_goes_before_the_flooding_keys_second_request() -> None:
    flood = [f"a{i}" for i in range(10)]
    fair, fcfs = make_scheduler("fair"), make_scheduler("fcfs")
    for sched in (fair, fcfs):
        for i, rid in enumerate(flood):
            add(sched, rid, 4, key="A", first=10 * i)
        add(sched, "b0", 4, key="B", first=500)
    # Equal counters: the older head first; then A has been served and B has not.
    assert admitted(fair.schedule()) == ["a0", "b0", *flood[1:]]
    assert admitted(fcfs.schedule()) == [*flood, "b0"]


def test_with_one_slot_free_the_light_key_gets_it() -> None:
    sched = make_scheduler(max_seqs=2)
    for i in range(5):
        add(sched, f"a{i}", 4, key="A", first=10 * i)
    add(sched, "b0", 4, key="B", first=500)
    assert admitted(sched.schedule()) == ["a0", "b0"]
    assert ids(list(sched.waiting)) == ["a1", "a2", "a3", "a4"]


def test_weights_two_to_one_share_the_service_two_to_one() -> None:
    sched = make_scheduler(max_seqs=3, budget=16)
    output_len = 8
    for i in range(100):  # both keys stay backlogged for the whole run
        add(sched, f"a{i}", 8, key="A", weight=2.0, first=10 * i, max_tokens=output_len)
        add(sched, f"b{i}", 8, key="B", weight=1.0, first=2000 + 10 * i, max_tokens=output_len)
    generated: Counter[str | None] = Counter()
    for _ in range(300):
        sampled = run_step(sched.schedule())
        generated.update(r.fairness_key for r in sampled)
        finish_done(sched, sampled)
    assert sched.waiting.counter("A") == pytest.approx(sched.waiting.counter("B"), abs=12)
    assert generated["A"] / generated["B"] == pytest.approx(2.0, rel=0.05)


def test_service_counts_prompt_chunks_as_computed_and_output_tokens_twice() -> None:
    sched = make_scheduler(budget=32, caching=False)
    add(sched, "a", 50, key="A", weight=2.0)
    counter = lambda: sched.waiting.counter("A")  # noqa: E731
    run_step(sched.schedule())
    assert counter() == 32 * PREFILL_TOKEN_COST / 2
    run_step(sched.schedule())  # the last 18 prompt tokens, and the first output token
    assert counter() == (50 * PREFILL_TOKEN_COST + DECODE_TOKEN_COST) / 2
    run_step(sched.schedule())  # one decode step
    assert counter() == (50 * PREFILL_TOKEN_COST + 2 * DECODE_TOKEN_COST) / 2


def test_prefix_hits_and_recompute_after_preemption_are_not_service() -> None:
    sched = make_scheduler(budget=64, block_size=4)
    a = add(sched, "a", 50, key="A")
    run_step(sched.schedule())
    served = sched.waiting.counter("A")
    assert served == 50 * PREFILL_TOKEN_COST + DECODE_TOKEN_COST
    add(sched, "b", 52, key="A")  # its first 48 tokens are a's cached blocks
    run_step(sched.schedule())
    served += DECODE_TOKEN_COST  # a decodes
    served += 4 * PREFILL_TOKEN_COST + DECODE_TOKEN_COST  # b computes its 4 uncached tokens
    assert sched.waiting.counter("A") == served
    sched.preempt(a)
    out = sched.schedule()
    assert ("a", 52 - 48) in [(r.request_id, n) for r, n in out.scheduled]  # recomputes
    run_step(out)
    served += 2 * DECODE_TOKEN_COST  # b decodes; a samples one new token, nothing else counts
    assert sched.waiting.counter("A") == served


# -- returning from idle ------------------------------------------------------------------------


def test_a_key_back_from_idle_starts_at_the_least_backlogged_counter() -> None:
    sched = make_scheduler(max_seqs=2)
    for i in range(6):
        add(sched, f"a{i}", 8, key="A", first=10 * i, max_tokens=4)
    add(sched, "b0", 8, key="B", first=500, max_tokens=4)
    while any(r.fairness_key == "B" for r in sched.running) or any(
        r.fairness_key == "B" for r in sched.waiting
    ):
        finish_done(sched, run_step(sched.schedule()))
    for _ in range(6):  # A alone for a while: B is idle and owed nothing for it
        finish_done(sched, run_step(sched.schedule()))
    idle_b = sched.waiting.counter("B")
    assert sched.waiting and idle_b < sched.waiting.counter("A")
    add(sched, "b1", 8, key="B", first=600)
    assert sched.waiting.counter("B") == sched.waiting.counter("A")
    add(sched, "c0", 8, key="C", first=700)  # never seen: not zero either
    assert sched.waiting.counter("C") == sched.waiting.counter("A") > 0


def test_a_key_keeps_a_counter_above_the_floor() -> None:
    sched = make_scheduler(max_seqs=1)
    add(sched, "b0", 40, key="B", max_tokens=1)
    add(sched, "a0", 4, key="A", first=100)
    add(sched, "a1", 4, key="A", first=200)
    finish_done(sched, run_step(sched.schedule()))  # b0 done at once; B idle, well served
    assert sched.waiting.counter("B") > sched.waiting.counter("A")
    b_served = sched.waiting.counter("B")
    add(sched, "b1", 4, key="B", first=300)
    assert sched.waiting.counter("B") == b_served


def test_with_nothing_waiting_a_returning_key_starts_at_the_last_admitted_keys_counter() -> None:
    sched = make_scheduler()
    add(sched, "a0", 20, key="A")
    add(sched, "b0", 4, key="B", first=100)
    for _ in range(3):
        run_step(sched.schedule())
    assert not sched.waiting
    add(sched, "c0", 4, key="C", first=200)
    assert sched.waiting.counter("C") == sched.waiting.counter("B")  # b0 was admitted last


# -- preemption -------------------------------------------------------------------------------


def preemption_scene(policy: str) -> tuple[Scheduler, SchedulerOutput]:
    """6 blocks of 4 tokens. A's a0 and a1 (7 tokens) run first; B's b0 (3 tokens, weight 2)
    joins while A's a2 waits; then a0 and a1 each need a third block and one is free."""
    sched = make_scheduler(policy, num_blocks=6, block_size=4, caching=False)
    add(sched, "a0", 7, key="A")
    add(sched, "a1", 7, key="A", first=100)
    run_step(sched.schedule())
    add(sched, "b0", 3, key="B", weight=2.0, first=200)
    add(sched, "a2", 7, key="A", first=300)
    out = sched.schedule()
    assert admitted(out) == ["a0", "a1", "b0"] and sched.kv.num_free_blocks == 1  # a2 waits
    run_step(out)
    return sched, sched.schedule()


def test_the_victim_is_the_newest_request_of_the_most_served_key() -> None:
    sched, out = preemption_scene("fair")
    assert sched.waiting.counter("A") > sched.waiting.counter("B")
    assert ids(out.preempted) == ["a1"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a0", 1), ("b0", 1)]
    assert ids(list(sched.waiting)) == ["a1", "a2"]  # back in front of its key's line
    a1 = out.preempted[0]
    assert a1.status == RequestStatus.PREEMPTED and a1.num_computed_tokens == 0


def test_fcfs_preempts_the_newest_request() -> None:
    sched, out = preemption_scene("fcfs")
    assert ids(out.preempted) == ["b0"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a0", 1), ("a1", 1)]
    assert ids(list(sched.waiting)) == ["b0", "a2"]


def test_a_victim_planned_earlier_in_the_step_is_taken_back_out_of_the_plan() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    a0 = add(sched, "a0", 11, key="A")
    add(sched, "b0", 4, key="B", first=100)
    run_step(sched.schedule())  # a0: 12 tokens in 3 blocks, b0: 5 tokens in 1 block
    out = sched.schedule()
    # a0's decode row is planned (completing its third block); then b0 needs a block, none
    # is free, and A is the most-served key.
    assert ids(out.preempted) == ["a0"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b0", 1)]
    assert out.num_batched_tokens == 1 and len(sched.kv.block_ids("b0")) == 2
    # Only blocks whose KV was computed can be hit: a0's first two, not the third.
    probe = Request("probe", a0.all_token_ids + [1, 2, 3, 4], SamplingParams(), None)
    assert sched.kv.get_computed_blocks(probe)[1] == 8


# -- nothing to be fair about -------------------------------------------------------------------


def trace(policy: str, keyed: bool, seed: int = 3) -> list[tuple]:
    """A random workload with arrivals, chunking, finishes and preemptions: every step's
    plan, victims and waiting line."""
    rng = random.Random(seed)
    sched = make_scheduler(policy, num_blocks=20, block_size=4, budget=24, max_seqs=5)
    keys = ["A", "B", "C", None]
    steps: list[tuple] = []
    next_id = 0
    for _ in range(120):
        for _ in range(rng.choice([0, 0, 1, 2])):
            key, weight = rng.choice(keys), rng.choice([0.5, 1.0, 3.0])
            size, first = rng.randint(1, 20), rng.randrange(1000)
            if not keyed:
                key, weight = None, 1.0
            add(sched, f"r{next_id}", size, key, weight, first, max_tokens=rng.randint(1, 12))
            next_id += 1
        out = sched.schedule()
        steps.append(
            (
                [(r.request_id, n) for r, n in out.scheduled],
                ids(out.preempted),
                ids(list(sched.waiting)),
            )
        )
        finish_done(sched, run_step(out))
        running = Counter(r.fairness_key if policy == "fair" else None for r in sched.running)
        queue = sched.waiting.band_queue(0)
        lines = {} if queue is None else queue._lines
        tracked = {k: line.num_running for k, line in lines.items()}
        assert all(tracked.get(k, 0) == n for k, n in running.items())
        assert sum(tracked.values()) == len(sched.running)
    assert sum(len(step[1]) for step in steps) > 0  # the workload does preempt
    return steps


def test_a_keyless_workload_is_scheduled_exactly_as_fcfs() -> None:
    assert trace("fair", keyed=False) == trace("fcfs", keyed=False)


def test_fcfs_ignores_keys_and_weights() -> None:
    assert trace("fcfs", keyed=True) == trace("fcfs", keyed=False)
    assert trace("fair", keyed=True) != trace("fcfs", keyed=True)


def test_the_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model="m", scheduling_policy="lottery")
    with pytest.raises(ValueError, match="fair, priority, fcfs"):
        make_scheduler("lottery")


# -- end to end ---------------------------------------------------------------------------------


def engine(model: Path, policy: str) -> LLMEngine:
    # 20 blocks of 16 tokens for about 700 tokens of demand: requests get preempted.
    return LLMEngine(
        EngineConfig(
            model=str(model),
            scheduling_policy=policy,
            num_kv_blocks=20,
            max_model_len=160,
            max_num_batched_tokens=64,
            dtype="float32",
        )
    )


def run_mixed(core: LLMEngine) -> dict[str, list[int]]:
    rng = random.Random(7)
    tenants = [("A", 1.0), ("A", 1.0), ("B", 3.0), (None, 1.0), ("C", 0.5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(10):
        key, weight = tenants[i % len(tenants)]
        prompt = [rng.randrange(10, 8000) for _ in range(rng.randint(20, 100))]
        core.add(EngineRequest(f"r{i}", prompt, params, fairness_key=key, fairness_weight=weight))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(10)}
    while core.has_unfinished_requests():
        for update in core.step():
            tokens[update.request_id].extend(update.new_token_ids)
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks
    return tokens


def test_greedy_outputs_with_mixed_keys_and_weights_equal_fcfs(demo_model_dir: Path) -> None:
    fair, fcfs = engine(demo_model_dir, "fair"), engine(demo_model_dir, "fcfs")
    fair_tokens, fcfs_tokens = run_mixed(fair), run_mixed(fcfs)
    assert all(len(t) == 24 for t in fair_tokens.values())
    assert fair_tokens == fcfs_tokens
    assert fair.scheduler.num_preemptions > 0 and fcfs.scheduler.num_preemptions > 0


def test_the_weight_crosses_the_engine_process_pipe() -> None:
    add = EngineRequest("r", [1, 2], SamplingParams(), None, None, "tenant", 2.5)
    assert pickle.loads(pickle.dumps(add)).fairness_weight == 2.5


async def test_generate_passes_the_weight_to_the_engine_and_refuses_a_bad_one(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = engine(demo_model_dir, "fair")
    seen = []
    add = core.add

    def spy(request: EngineRequest, received_at: float | None = None) -> list[int]:
        seen.append((request.fairness_key, request.fairness_weight))
        return add(request, received_at)

    monkeypatch.setattr(core, "add", spy)
    client = AsyncEngine(core)
    client.start()
    params = SamplingParams(temperature=0, max_tokens=2)
    ok = EngineRequest("ok", [11, 12, 13], params, fairness_key="t", fairness_weight=2.5)
    async for _ in client.generate(ok):
        pass
    for weight in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="fairness_weight"):
            async for _ in client.generate(
                EngineRequest("bad", [11], params, fairness_weight=weight)
            ):
                pass
    assert seen[0] == ("t", 2.5)
    await client.shutdown(0)


# -- sharing the sequence slots -------------------------------------------------------------------


def test_a_key_arriving_to_full_slots_takes_one_from_the_key_above_its_share() -> None:
    sched = make_scheduler(max_seqs=4)
    flood = [add(sched, f"a{i}", 4, key="A", first=10 * i) for i in range(6)]
    sampled = run_step(sched.schedule())
    assert ids(sampled) == ["a0", "a1", "a2", "a3"]
    add(sched, "b0", 4, key="B", first=500)
    out = sched.schedule()
    # A held every slot, its share is 2: its newest running request makes room for b0.
    assert ids(out.preempted) == [] and sched.num_fairness_preemptions == 1
    assert admitted(out) == ["a0", "a1", "a2", "b0"]
    assert flood[3].status == RequestStatus.PREEMPTED
    assert ids(list(sched.waiting)) == ["a3", "a4", "a5"]
    # B now holds one slot of its two and waits for nothing: no more preemption.
    run_step(out)
    assert admitted(sched.schedule()) == ["a0", "a1", "a2", "b0"]
    assert sched.num_fairness_preemptions == 1


def test_slots_do_not_change_hands_between_keys_at_their_share() -> None:
    # Eight keys, four slots, one request each: every running key holds its one slot.
    sched = make_scheduler(max_seqs=4)
    for i in range(8):
        add(sched, f"k{i}", 4, key=f"K{i}", first=10 * i)
    for _ in range(5):
        run_step(sched.schedule())
    assert sched.num_fairness_preemptions == 0
    # Two keys, equal weights, two slots each: the waiting requests wait their turn.
    sched = make_scheduler(max_seqs=4)
    for i in range(4):
        add(sched, f"a{i}", 4, key="A", first=10 * i)
        add(sched, f"b{i}", 4, key="B", first=500 + 10 * i)
    for _ in range(5):
        run_step(sched.schedule())
    assert sched.num_fairness_preemptions == 0
    assert Counter(r.fairness_key for r in sched.running) == {"A": 2, "B": 2}


def test_no_slot_is_taken_for_a_request_that_could_not_run() -> None:
    sched = make_scheduler(max_seqs=2)
    for i in range(2):
        add(sched, f"a{i}", 4, key="A", first=10 * i)
    run_step(sched.schedule())
    blocked = add(sched, "b0", 4, key="B", first=500)
    sched.admission_gates.append(lambda request: request is not blocked)  # still compiling
    run_step(sched.schedule())
    assert sched.num_fairness_preemptions == 0
    sched.admission_gates.clear()
    assert admitted(sched.schedule()) == ["a0", "b0"]
    assert sched.num_fairness_preemptions == 1
