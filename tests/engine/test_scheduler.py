"""Scheduler: token budget, chunked prefill, max_num_seqs, prefix hits, preemption order."""

from __future__ import annotations

from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def make_scheduler(
    num_blocks: int = 100,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 8,
    chunked: bool = True,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, SchedulerConfig(max_seqs, budget, enable_chunked_prefill=chunked))


def add(sched: Scheduler, rid: str, num_tokens: int, first: int = 0) -> Request:
    request = Request(
        rid, list(range(first, first + num_tokens)), SamplingParams(max_tokens=100), None
    )
    sched.add_request(request)
    return request


def run_step(sched: Scheduler, out: SchedulerOutput, next_token: int = 7) -> None:
    """What the engine does after a forward: advance progress, append a token to sampled rows."""
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(next_token)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def test_prompts_are_chunked_to_the_token_budget() -> None:
    sched = make_scheduler(budget=32)
    add(sched, "a", 50)
    add(sched, "b", 10, first=100)
    out = sched.schedule()
    assert plan(out) == [("a", 32)]
    run_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 18), ("b", 10)]
    run_step(sched, out)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]  # both decode now


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_scheduler(budget=32, chunked=False)
    add(sched, "a", 20)
    add(sched, "b", 20, first=100)
    out = sched.schedule()
    assert plan(out) == [("a", 20)]
    run_step(sched, out)
    assert plan(sched.schedule()) == [("a", 1), ("b", 20)]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_seqs=2)
    for i, rid in enumerate("abc"):
        add(sched, rid, 4, first=10 * i)
    out = sched.schedule()
    assert plan(out) == [("a", 4), ("b", 4)]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_identical_prompts_admitted_together_share_blocks_in_the_same_step() -> None:
    sched = make_scheduler(block_size=4)
    add(sched, "a", 10)
    add(sched, "b", 10)
    out = sched.schedule()
    assert plan(out) == [("a", 10), ("b", 2)]
    assert sched.kv.block_ids("a")[:2] == sched.kv.block_ids("b")[:2]


def test_prefix_hit_skips_cached_blocks() -> None:
    sched = make_scheduler(block_size=4)
    a = add(sched, "a", 12)
    run_step(sched, sched.schedule())
    b = add(sched, "b", 14)  # same first 12 tokens
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 14 - 12)]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert a.num_cached_tokens == 0


def test_running_out_of_blocks_preempts_the_most_recently_admitted() -> None:
    # 6 blocks of 4 tokens; three requests of 7 tokens take 2 blocks each.
    sched = make_scheduler(num_blocks=6, block_size=4, caching=False)
    reqs = [add(sched, rid, 7, first=10 * i) for i, rid in enumerate("abc")]
    run_step(sched, sched.schedule())  # all three prefilled, each now 8 tokens
    assert sched.kv.num_free_blocks == 0
    run_step(sched, sched.schedule())  # each decodes into slot 8: needs a third block
    out = sched.schedule()
    # "a" needs a block: "c" (newest) goes; then "b" needs one: nothing left to take but itself.
    assert [r.request_id for r in out.preempted] == ["c"]
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert plan(out) == [("a", 1), ("b", 1)]


def test_a_step_that_preempts_admits_nothing_new() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, caching=False)
    add(sched, "a", 8)
    add(sched, "b", 8, first=100)
    run_step(sched, sched.schedule())
    add(sched, "c", 1, first=200)
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert plan(out) == [("a", 1)]


def test_finish_frees_blocks_and_leaves_the_queues() -> None:
    sched = make_scheduler(num_blocks=10)
    a = add(sched, "a", 9)
    b = add(sched, "b", 9, first=100)
    sched.schedule()
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert sched.running == [b]
    sched.finish(b, RequestStatus.FINISHED_STOPPED)
    assert not sched.has_unfinished
    assert sched.kv.num_free_blocks == 10


def test_a_request_held_by_an_admission_gate_blocks_nobody_and_keeps_its_place() -> None:
    sched = make_scheduler()
    ready = {"b", "c"}
    sched.admission_gates.append(lambda r: r.request_id in ready)
    add(sched, "a", 8)
    add(sched, "b", 8, first=100)
    add(sched, "c", 8, first=200)
    out = sched.schedule()
    assert plan(out) == [("b", 8), ("c", 8)]
    assert [r.request_id for r in sched.waiting] == ["a"]
    run_step(sched, out)
    ready.add("a")
    assert plan(sched.schedule()) == [("b", 1), ("c", 1), ("a", 8)]
