"""Priority bands over the fair lines: lower `priority` runs first, fairness within a band.

Every request carries a `priority` (vLLM's field and meaning: lower runs first; 0 by default,
batch lines in a band below, `--batch-priority`). Each priority value present is a band, and
each band is a FairQueue of its own (engine/fairness.py): one line per fairness key, its
virtual token counters, its below-share keys. Bands are strictly ordered:

- admission takes from the best band with an admissible request before any worse one;
- the scheduler plans running rows best band first (`order`), so a worse band's prompt chunks
  get what the step's token budget has left: they fill the spare budget;
- memory and sequence slots are taken from the worst band first (`victim`, `slot_victim`):
  a request is never preempted for a worse band's work;
- while two or more bands are present, the whole best band is *favoured* (`Favour`), as a key
  below its share is within one band: the scheduler keeps the worse bands' prompt chunks
  short while the best band is present, gives its prompts the step, and reserves its decode
  rows their token.

One exception to strict order, so that a worse band is never starved for long: a band with
requests waiting that has admitted none for `max_wait` seconds while a better band kept the
engine full gets its head admitted next, promoted into the best band present (it then runs as
one of them, and is preempted no sooner than they are). The bound is per band: at least one of
its requests starts every `max_wait` seconds.

Policies: "fair" (bands, fair lines within them), "priority" (bands, first come first served
within them: vLLM's priority policy), "fcfs" (one band and one line; `priority` is ignored).

A band is "present" while it has requests waiting or running, or its last one left under
LINGER seconds ago (engine/fairness.py's notion, for the same reason: traffic that pauses
between requests should still find short steps when it returns).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from engine.config import SCHEDULING_POLICIES
from engine.fairness import LINGER, FairQueue
from engine.request import Request

DEFAULT_MAX_WAIT = 30.0  # seconds a waiting band may go without an admission


@dataclass(frozen=True, slots=True)
class Favour:
    """Whose work the scheduler protects this step (engine/scheduler.py): the best band's
    requests, all of them (`whole`: another band is present) or those of its keys below
    their share (`keys`). Nobody when the best band is alone and nobody is below share."""

    band: int = 0
    whole: bool = False
    keys: frozenset[str | None] = frozenset()
    banded: bool = True  # False (policy fcfs): every request is in band 0

    def __contains__(self, request: Request) -> bool:
        if self.banded and request.priority != self.band:
            return False
        return self.whole or request.fairness_key in self.keys

    def __bool__(self) -> bool:
        return self.whole or bool(self.keys)


NOBODY = Favour()


@dataclass(slots=True, eq=False)
class _Band:
    priority: int
    queue: FairQueue
    num_running: int = 0
    left_at: float = -math.inf  # when its last waiting or running request left
    # When it last admitted a request, or became backlogged if later: its wait's start.
    served_at: float = -math.inf


@dataclass(slots=True)
class BandedQueue:
    """The scheduler's waiting requests: a FairQueue per priority band, bands in order.

    Iterating yields every waiting request, best band first (a snapshot, as FairQueue's)."""

    policy: str = "fair"
    max_wait: float = DEFAULT_MAX_WAIT
    clock: Callable[[], float] = time.monotonic
    _bands: dict[int, _Band] = field(default_factory=dict)
    _order: list[int] = field(default_factory=list)  # the bands' priorities, sorted
    num_promotions: int = 0  # requests admitted out of band order by the starvation bound

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}")
        if not self.max_wait > 0:
            raise ValueError(f"max_wait must be positive, got {self.max_wait}")

    @property
    def banded(self) -> bool:
        return self.policy != "fcfs"

    @property
    def use_keys(self) -> bool:
        return self.policy == "fair"

    def __len__(self) -> int:
        return sum(len(band.queue) for band in list(self._bands.values()))

    def __iter__(self) -> Iterator[Request]:
        bands = [self._bands.get(p) for p in list(self._order)]
        return iter([r for band in bands if band is not None for r in band.queue])

    def band_of(self, request: Request) -> int:
        return request.priority if self.banded else 0

    def band_queue(self, priority: int = 0) -> FairQueue | None:
        """A band's FairQueue (None: no such band now)."""
        band = self._bands.get(priority if self.banded else 0)
        return None if band is None else band.queue

    def counter(self, key: str | None, priority: int = 0) -> float:
        """A key's virtual token counter in a band (0 for one never seen)."""
        band = self._bands.get(priority if self.banded else 0)
        return 0.0 if band is None else band.queue.counter(key)

    # -- waiting ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        band = self._band(request)
        if not band.queue:
            band.served_at = max(band.served_at, self.clock())
        band.queue.add(request)

    def push_front(self, request: Request) -> None:
        band = self._band(request)
        if not band.queue:
            band.served_at = max(band.served_at, self.clock())
        band.queue.push_front(request)

    def remove(self, request: Request) -> None:
        band = self._bands.get(self.band_of(request))
        if band is None:
            raise ValueError(f"{request!r} is not waiting")
        band.queue.remove(request)
        band.left_at = self.clock()

    def pop_next(self, favour: Favour | None = None) -> Request | None:
        """The next request to admit: the best band's next (its least-served key's head), or,
        once a band has waited max_wait without an admission, that band's head, promoted into
        the best band. With `favour`: only favoured requests."""
        waiting = [self._bands[p] for p in self._order if self._bands[p].queue]
        if not waiting:
            return None
        now = self.clock()
        overdue = [b for b in waiting[1:] if now - b.served_at > self.max_wait]
        if overdue:
            starved = min(overdue, key=lambda b: b.served_at)
            request = starved.queue.pop_next()
            assert request is not None
            starved.served_at = now
            self.num_promotions += 1
            request.priority = self._order[0]  # it runs as one of the best band now
            return request
        band = waiting[0] if favour is None else self._bands.get(favour.band)
        if band is None:
            return None
        only = None if favour is None or favour.whole else favour.keys
        request = band.queue.pop_next(only)
        if request is not None:
            band.served_at = now
        return request

    def pop_better(self, than: int) -> Request | None:
        """The next request of the best waiting band, if that band is better than `than` (a
        suspended step's worst: engine/give_way.py); no band is promoted."""
        for priority in self._order:
            band = self._bands[priority]
            if not band.queue:
                continue
            if priority >= than:
                return None
            request = band.queue.pop_next()
            if request is not None:
                band.served_at = self.clock()
            return request
        return None

    def waiting_heads(self, favour: Favour) -> list[Request]:
        """The heads of the favoured lines that have requests waiting."""
        band = self._bands.get(favour.band)
        if band is None:
            return []
        if favour.whole:
            return band.queue.waiting_heads(band.queue.backlogged_keys())
        return band.queue.waiting_heads(favour.keys)

    # -- running ----------------------------------------------------------------------------

    def admitted(self, request: Request, num_prompt_tokens: int | None = None) -> None:
        band = self._band(request)
        band.num_running += 1
        band.queue.admitted(request, num_prompt_tokens)

    def left_running(self, request: Request, finished: bool = False) -> None:
        band = self._bands[self.band_of(request)]
        band.num_running -= 1
        band.left_at = self.clock()
        band.queue.left_running(request, finished)

    def order(self, running: list[Request], request: Request) -> None:
        """Put a newly admitted request in `running`: after every request of its band or a
        better one, before the worse bands' (admission order within a band)."""
        if self.banded:
            bisect.insort_right(running, request, key=lambda r: r.priority)
        else:
            running.append(request)

    def charge(self, rows: list[tuple[Request, int]]) -> None:
        """Each band's rows charged to its own lines (one call per band, not per row)."""
        if not self.use_keys:
            return
        if len(self._bands) == 1:
            next(iter(self._bands.values())).queue.charge(rows)
            return
        by_band: dict[int, list[tuple[Request, int]]] = {}
        for row in rows:
            by_band.setdefault(row[0].priority, []).append(row)
        for priority, band_rows in by_band.items():
            self._bands[priority].queue.charge(band_rows)

    # -- whom the step protects -------------------------------------------------------------

    def favour(self) -> Favour:
        """This step's favoured requests: the best present band's whole, if another band is
        present too; else its keys below their share."""
        now = self.clock()
        for priority in list(self._order):
            band = self._bands[priority]
            idle = not band.queue and band.num_running == 0
            if idle and now - band.left_at >= LINGER:
                del self._bands[priority]
                self._order.remove(priority)
        if not self._order:
            return NOBODY
        best = self._bands[self._order[0]]
        if len(self._order) > 1:
            return Favour(best.priority, whole=True, banded=self.banded)
        return Favour(best.priority, keys=best.queue.below_share(), banded=self.banded)

    def typical_prompt(self, favour: Favour) -> float:
        band = self._bands.get(favour.band)
        if band is None:
            return 0.0
        keys = band.queue.keys() if favour.whole else favour.keys
        return band.queue.typical_prompt(keys)

    def prompt_need(self, running: list[Request], num_slots: int, favour: Favour) -> float:
        """Prompt tokens a step must compute for the requests not favoured to keep the slots
        the favoured leave them decoding (FairQueue.prompt_need, over every band's lines)."""
        free = num_slots - sum(1 for r in running if r in favour)
        ratio = 0.0
        for band in list(self._bands.values()):
            mine = [r for r in running if self.band_of(r) == band.priority]
            exclude: Collection[str | None] = ()
            if band.priority == favour.band:
                exclude = band.queue.keys() if favour.whole else favour.keys
            ratio = max(ratio, band.queue.prompt_ratio(mine, exclude))
        return ratio * free

    def victim(self, running: list[Request], requester: Request | None, favour: Favour) -> Request:
        """The request to preempt when memory runs out for `requester`: from the worst band
        running (never a better band than the requester's: then the requester itself), the
        band's fair victim, sparing its below-share keys' work for the others'."""
        worst = max(self.band_of(r) for r in running)
        if requester is not None and self.band_of(requester) > worst:
            return requester  # only better bands run: it waits for them
        band = self._bands[worst]
        mine = [r for r in running if self.band_of(r) == worst]
        protected = favour.keys if favour.band == worst and not favour.whole else ()
        if requester is not None and self.band_of(requester) < worst:
            requester, protected = None, ()  # a better band's work: any of these gives way
        return band.queue.victim(mine, requester, protected)

    def slot_victim(
        self,
        running: list[Request],
        num_slots: int,
        admissible: Callable[[Request], bool],
        favour: Favour,
    ) -> Request | None:
        """With every sequence slot taken: the running request to give up its slot, or None.
        A better band's admissible head takes a slot from the worst band running; within one
        band, FairQueue's rules (slots by weighted share)."""
        if not running:
            return None
        worst = max(self.band_of(r) for r in running)
        for priority in self._order:
            if priority >= worst:
                break
            band = self._bands[priority]
            if any(admissible(r) for r in band.queue.waiting_heads(band.queue.backlogged_keys())):
                mine = [r for r in running if self.band_of(r) == worst]
                return self._bands[worst].queue.victim(mine)
        if any(self.band_of(r) != worst for r in running):
            return None  # several bands run: the worst keeps its slots until a better one asks
        band = self._bands[worst]
        keys = favour.keys if favour.band == worst and not favour.whole else ()
        return band.queue.slot_victim(running, num_slots, admissible, keys)

    # -- internals --------------------------------------------------------------------------

    def _band(self, request: Request) -> _Band:
        priority = self.band_of(request)
        band = self._bands.get(priority)
        if band is None:
            queue = FairQueue(use_keys=self.use_keys, clock=self.clock)
            band = self._bands[priority] = _Band(priority, queue)
            bisect.insort(self._order, priority)
        return band
