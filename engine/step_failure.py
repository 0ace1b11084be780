"""When a step raises: find the requests that make it fail, so that only they fail.

A step is one forward pass over many tenants' requests; one request's bad input, or a bug
that it alone triggers, must not fail the others. The failed batch is re-run in halves,
recursively, until every failure is pinned to single requests: one culprit among n rows
costs 2 * log2(n) extra passes, paid only when a step fails.

A diagnostic run leaves nothing behind. It writes KV only into its own rows' slots, which
the rows' next real step writes again (the engine rolls the failed step back before that);
its samples are discarded, and seeded sampling depends on (seed, position) alone, so
drawing them changes no later token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

Rows = list[tuple[Request, int]]

# Failed steps in a row that no single request explains before their requests fail.
MAX_UNEXPLAINED_FAILURES = 8


class StepFailures:
    """The engine's answer to a step that raised: which requests fail, and the state every
    other request resumes from.

    `run` is a forward of some rows (the model runner's execute on a sub-batch); it raises
    as those rows do.
    """

    def __init__(self, run: Callable[[Rows], object], scheduler: Scheduler):
        self._run = run
        self._scheduler = scheduler
        self._num_unexplained = 0  # failed steps in a row with no culprit

    def step_succeeded(self) -> None:
        self._num_unexplained = 0

    def contain(self, scheduled: Rows, error: Exception) -> list[tuple[Request, Exception]]:
        """The requests that must fail for the step `scheduled` (which raised `error`), each
        with its error; every other request is rolled back to before the step, its tokens
        unchanged. Empty when the step fails only as a whole: then the batch is shrunk (a
        request preempted) and the next step tries again."""
        logger.warning(
            "a step of %d requests failed (%s: %s); re-running it in parts to find the "
            "requests that fail it",
            len(scheduled),
            type(error).__name__,
            error,
        )
        culprits = isolate_failures(scheduled, self._run, error)
        self._scheduler.roll_back(scheduled, failing={id(request) for request, _ in culprits})
        if not culprits:
            # Every part runs alone: the batch fails only as a whole (memory, say). Shrink it
            # by preempting the request that would go if KV blocks ran out; give up on the
            # step's requests only if that keeps failing.
            self._num_unexplained += 1
            if self._num_unexplained <= MAX_UNEXPLAINED_FAILURES:
                if self._scheduler.running:
                    self._scheduler.preempt(self._scheduler.preemption_victim())
                return []
            culprits = [(r, error) for r, _ in scheduled if r.status == RequestStatus.RUNNING]
        self._num_unexplained = 0
        return culprits


def failure_message(exc: BaseException) -> str:
    """The error a request that alone failed the engine ends with."""
    return f"the engine failed on this request: {type(exc).__name__}: {exc}"


def isolate_failures(
    rows: Rows, run: Callable[[Rows], object], error: Exception
) -> list[tuple[Request, Exception]]:
    """The requests of `rows` (which failed together with `error`) that fail on their own,
    each with its error. Empty when every half runs: the batch fails only as a whole."""
    if len(rows) == 1:
        return [(rows[0][0], error)]
    half = len(rows) // 2
    culprits: list[tuple[Request, Exception]] = []
    for part in (rows[:half], rows[half:]):
        try:
            run(part)
        except Exception as exc:  # noqa: BLE001 - a failure to pin down, not to propagate
            culprits += isolate_failures(part, run, exc)
    return culprits
