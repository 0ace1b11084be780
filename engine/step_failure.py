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

from collections.abc import Callable

from engine.request import Request

Rows = list[tuple[Request, int]]


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
