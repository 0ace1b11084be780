"""A step of worse-band rows gives way to a better band's request that arrives while it runs.

A request waits for the step under way before it can start, and a step full of a batch's
prompt chunks lasts tens of milliseconds: on two cores the wait for it was most of what an
interactive request's time to first token grew by beside a batch (docs/batches.md). So the
forward pass looks between its layers at what has been sent to the engine and not yet taken
in (`Arrivals`, kept by the loop that feeds the engine); when a request of a better band
than some of the step's rows is among it, the pass stops (`StepYielded`) and is kept,
suspended at that layer, with everything it has computed. The engine then runs interim steps
of the better bands' prompts alone (engine/scheduler.py `schedule_interim`), and resumes the
suspended pass where it stopped once none is due (engine/llm_engine.py). The suspended rows'
tokens are the same, only later, and none of their work is lost.

While a pass is suspended its rows' KV is written up to its layer only: the blocks it was to
fill leave the prefix cache until it ends (engine/kv_cache/manager.py `roll_back_step`), its
rows keep their blocks and their adapters' slots (an interim step neither preempts nor loads
an adapter), and an abort of one of its rows waits for its end.

Interactive requests are usually decoding beside a batch when the next one comes, so a step
with rows of the arrival's own band gives way too, if it also holds a worse band's: those
rows' next token then waits for the interim step, once per arrival.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

NONE_PENDING = 2**63  # worse than any priority a request may carry


class StepYielded(Exception):  # noqa: N818 - it is not an error: the step gave way
    """Raised between layers by a forward pass that gives way (LlamaForCausalLM.forward).

    `resume()` runs the rest of the pass from the layer it stopped at, and returns what the
    call that raised would have returned (ModelRunner.execute wraps the model's); it may give
    way again, raising a StepYielded of its own."""

    def __init__(self, resume: Callable[[], Any]) -> None:
        super().__init__()
        self.resume = resume


class Arrivals:
    """The best priority among the requests sent to the engine and not yet taken in.

    One thread notes each request as it is sent (before it is queued), the loop's thread
    clears the note before it takes in what is queued; a request queued between the two is
    taken in with a note left behind, which at worst stops one step for nothing. Reads and
    writes of one attribute are atomic under the GIL, so no lock: the forward pass reads it
    between layers."""

    __slots__ = ("best",)

    def __init__(self) -> None:
        self.best = NONE_PENDING

    def note(self, priority: int) -> None:
        if priority < self.best:
            self.best = priority

    def clear(self) -> None:
        self.best = NONE_PENDING


def give_way_check(arrivals: Arrivals, priorities: Iterable[int]) -> Callable[[], bool] | None:
    """What the step's forward pass asks between layers: has a request arrived of a better
    band than some of the step's rows (their `priorities`)? None for an empty step."""
    worst = max(priorities, default=None)
    if worst is None:
        return None

    def check() -> bool:
        return arrivals.best < worst

    return check
