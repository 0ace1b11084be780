"""Scheduler fixtures for the fairness tests: a scheduler over a small KV pool, requests with
fairness keys, and what the engine does after a step."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.kv_cache.manager import KVCacheManager
from engine.request import Owner, Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.step_cost import StepCost


def make_scheduler(
    policy: str = "fair",
    num_blocks: int = 100,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 16,
    caching: bool = True,
    step_cost: StepCost | None = None,
    clock: Callable[[], float] = time.monotonic,
    max_wait: float = 30.0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    config = SchedulerConfig(max_seqs, budget, policy=policy, priority_max_wait=max_wait)
    return Scheduler(kv, config, step_cost=step_cost, clock=clock)


def add(
    sched: Scheduler,
    rid: str,
    num_tokens: int,
    key: str | None = None,
    weight: float = 1.0,
    first: int = 0,
    max_tokens: int = 100,
    priority: int = 0,
) -> Request:
    request = Request(
        rid,
        list(range(first, first + num_tokens)),
        SamplingParams(max_tokens=max_tokens),
        None,
        Owner(fairness_key=key, fairness_weight=weight),
        priority=priority,
    )
    sched.add_request(request)
    return request


def run_step(out: SchedulerOutput, next_token: int = 7) -> list[Request]:
    """What the engine does after a forward; returns the rows that sampled a token."""
    sampled = []
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(next_token)
            sampled.append(request)
    return sampled


def finish_done(sched: Scheduler, sampled: list[Request]) -> None:
    for request in sampled:
        assert request.sampling_params.max_tokens is not None
        if request.num_output_tokens >= request.sampling_params.max_tokens:
            sched.finish(request, RequestStatus.FINISHED_LENGTH)


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def admitted(out: SchedulerOutput) -> list[str]:
    return [r.request_id for r, _ in out.scheduled]
