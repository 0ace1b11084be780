"""Fair admission across fairness keys: one FCFS line per key, virtual token counters (VTC).

After "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024). Each key has a
counter of the weighted service its requests received:

    counter += (PREFILL_TOKEN_COST * prompt tokens computed
                + DECODE_TOKEN_COST * output tokens generated) / the request's weight

charged as the scheduler plans each step (prompt chunks as they are scheduled, so a long
prompt counts step by step). The waiting request admitted next is the head of the line of
the backlogged key (one with waiting requests) with the least counter; within a key, first
come first served. A key returning from idle (nothing waiting, nothing running) starts at
no less than the least counter among the backlogged keys, or, when none is, the counter of
the last key admitted: service it did not ask for while idle is not owed to it later.
Preemption takes the most recently admitted running request of the most-served key.

Admission order alone cannot help a key whose request arrives while every sequence slot is
held by another key's long requests: it would wait for one of them to finish. So with every
slot taken, a key below its weighted share of the slots takes one from the key furthest above
its share (`slot_victim`): the victim's newest request is recomputed later, mostly from the
prefix cache, and a key is never pushed below its share, so slots do not change hands back
and forth.

What is not charged: prompt tokens read from the prefix cache (never computed), and the
recompute of a preempted request (the scheduler chose to throw that work away; charging it
again would make being preempted a penalty that invites the next preemption). A step that
fails after being planned keeps its charges: its requests fail or are recomputed, and the
error is at most one step's tokens.

Who is below their share now: VTC's counters say who was served least since the keys became
busy, not who is being served least at the moment, and a light key floored on every return
from idle ties the flooding key it returns to. So each key also keeps its recent service, the
same weighted charges decayed with a half-life of RATE_HALF_LIFE seconds. A key is *below its
share* while it is present (requests waiting or running, or its last one left under LINGER
seconds ago) and its recent service is under BELOW_SHARE of the most-served present key's.
With one key present nobody is. The scheduler protects such keys (engine/scheduler.py): it
keeps steps short while one is present, gives its prefill the step, lets it take a sequence
slot beyond its count share, and never preempts its requests for another key's.

Requests without a key share one line (key None). With `use_keys=False` (policy "fcfs")
every request is in that one line and nothing is charged: plain first come first served.

Cost: admission scans the backlogged keys' counters (O(backlogged keys) per admitted
request), a returning key scans them once, a preemption scans the running requests;
charging is O(1) per scheduled row. Backlogged keys are few at any moment even with
thousands of tenants. A key's counter is kept while it is idle (one small object per key
ever seen, as tenants are bounded).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from engine.request import Request

# The paper's weights: an output token costs twice a prompt token (w_p = 1, w_q = 2).
PREFILL_TOKEN_COST = 1.0
DECODE_TOKEN_COST = 2.0

RATE_HALF_LIFE = 5.0  # seconds: how fast a key's recent service is forgotten
# A present key whose recent service is under this fraction of the most-served present key's
# (per weight) is below its share: it asks for little, or is held back.
BELOW_SHARE = 0.5
LINGER = 2.0  # seconds a key stays present after its last request left
PROMPT_EWMA = 0.25  # weight of the newest request in a key's typical prompt and output


@dataclass(slots=True, eq=False)
class _Line:
    """One key's waiting requests (in line order), counter and running-request count."""

    key: str | None
    waiting: deque[Request] = field(default_factory=deque)
    counter: float = 0.0
    num_running: int = 0
    weight: float = 1.0  # the latest request's: a tenant's weight may change between them
    recent: float = 0.0  # weighted service, decayed (RATE_HALF_LIFE) as of recent_at
    recent_at: float = 0.0
    left_at: float = -math.inf  # when its last running or waiting request left
    typical_prompt: float = 0.0  # tokens its admitted prompts computed (EWMA); 0: none yet
    typical_output: float = 0.0  # tokens its finished requests generated (EWMA); 0: none yet


class FairQueue:
    """The scheduler's waiting requests, in one line per fairness key, and the keys' virtual
    token counters.

    Iterating yields every waiting request, each key's in line order, keys in the order they
    became backlogged (a snapshot: safe to take from another thread for stats).
    """

    def __init__(
        self, *, use_keys: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.use_keys = use_keys
        self.clock = clock
        self._lines: dict[str | None, _Line] = {}
        # Lines with waiting requests, in the order they became backlogged.
        self._backlog: dict[str | None, _Line] = {}
        # Lines present (waiting, running, or left under LINGER seconds ago), pruned lazily.
        self._present: dict[str | None, _Line] = {}
        self._last_admitted: _Line | None = None
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Request]:
        # list() of a dict view or a deque is one C call under the GIL: no "changed during
        # iteration" when a stats reader races the loop thread.
        lines = list(self._backlog.values())
        return iter([request for line in lines for request in list(line.waiting)])

    def counter(self, key: str | None) -> float:
        """The key's virtual token counter (0 for a key never seen)."""
        line = self._lines.get(key if self.use_keys else None)
        return 0.0 if line is None else line.counter

    # -- the lines --------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """A new request, at the back of its key's line."""
        line = self._line(request)
        line.weight = request.fairness_weight
        if self.use_keys and not line.waiting and line.num_running == 0:
            line.counter = max(line.counter, self._floor())
        line.waiting.append(request)
        self._now_waiting(line)
        self._present[line.key] = line

    def push_front(self, request: Request) -> None:
        """A request back at the head of its key's line: preempted, or taken out to be
        admitted and not admitted after all."""
        line = self._line(request)
        line.waiting.appendleft(request)
        self._now_waiting(line)

    def pop_next(self, only: Collection[str | None] | None = None) -> Request | None:
        """Take the next request to admit: the head of the least-served backlogged key's line
        (ties: the older head first), among the keys `only` if given; None when nothing
        waits there."""
        if not self._backlog:
            return None
        if only is not None:
            lines = [line for line in self._backlog.values() if line.key in only]
            if not lines:
                return None
            line = min(lines, key=_priority)
        elif len(self._backlog) == 1:
            line = next(iter(self._backlog.values()))
        else:
            line = min(self._backlog.values(), key=_priority)
        request = line.waiting.popleft()
        if not line.waiting:
            del self._backlog[line.key]
        self._num_waiting -= 1
        return request

    def remove(self, request: Request) -> None:
        """Take a waiting request out of line; ValueError if it is not waiting."""
        line = self._lines.get(self._key(request))
        if line is None:
            raise ValueError(f"{request!r} is not waiting")
        line.waiting.remove(request)
        self._num_waiting -= 1
        if not line.waiting:
            del self._backlog[line.key]
        line.left_at = self.clock()

    # -- running requests and their service -------------------------------------------------

    def admitted(self, request: Request, num_prompt_tokens: int | None = None) -> None:
        """A request started running; `num_prompt_tokens`: the prompt tokens it computes (not
        read from the prefix cache), for its key's typical prompt; None for a recompute."""
        line = self._line(request)
        line.num_running += 1
        self._last_admitted = line
        self._present[line.key] = line
        if num_prompt_tokens is not None:
            line.typical_prompt = _ewma(line.typical_prompt, num_prompt_tokens)

    def left_running(self, request: Request, finished: bool = False) -> None:
        """A running request finished or was preempted."""
        line = self._line(request)
        line.num_running -= 1
        line.left_at = self.clock()
        if finished:
            line.typical_output = _ewma(line.typical_output, request.num_output_tokens)

    def charge(self, rows: Iterable[tuple[Request, int]]) -> None:
        """Count scheduled rows' service: for each (request, tokens it computes this step),
        the prompt tokens it computes for the first time, and the token it samples if it
        reaches the end of its sequence."""
        if not self.use_keys:
            return
        lines = self._lines
        now = self.clock()
        for request, num_new in rows:
            start = request.num_computed_tokens
            end = start + num_new
            cost = DECODE_TOKEN_COST if end == request.num_tokens else 0.0
            charged = request.num_charged_prompt_tokens
            if end > charged and charged < request.num_prompt_tokens:
                new_end = min(end, request.num_prompt_tokens)
                cost += PREFILL_TOKEN_COST * (new_end - max(start, charged))
                request.num_charged_prompt_tokens = new_end
            line = lines[request.fairness_key]
            weighted = cost / request.fairness_weight
            line.counter += weighted
            if line.recent_at != now:  # decayed once per line per call, not per row
                line.recent = self._recent(line, now)
                line.recent_at = now
            line.recent += weighted

    def below_share(self) -> frozenset[str | None]:
        """The present keys below their share now: recent service under BELOW_SHARE of the
        most-served present key's. Empty with fewer than two keys present (or "fcfs")."""
        if not self.use_keys or len(self._present) < 2:
            return frozenset()
        now = self.clock()
        for key, line in list(self._present.items()):
            if not line.waiting and line.num_running == 0 and now - line.left_at >= LINGER:
                del self._present[key]
        if len(self._present) < 2:
            return frozenset()
        recent = {key: self._recent(line, now) for key, line in self._present.items()}
        bar = BELOW_SHARE * max(recent.values())
        return frozenset(key for key, service in recent.items() if service < bar)

    def typical_prompt(self, keys: Iterable[str | None]) -> float:
        """The longest typical prompt among the keys (a waiting head's length for a key with
        none admitted yet); 0 when nothing is known."""
        longest = 0.0
        for key in keys:
            line = self._lines.get(key)
            if line is None:
                continue
            typical = line.typical_prompt
            if typical == 0.0 and line.waiting:
                typical = float(line.waiting[0].num_tokens)
            longest = max(longest, typical)
        return longest

    def prompt_ratio(self, running: list[Request], exclude: Collection[str | None]) -> float:
        """Prompt tokens per decode slot and step that the keys not in `exclude` need to keep
        their slots decoding: the highest typical prompt / typical output among those keys
        with prompts to compute (running or waiting; a key with nothing finished yet: output
        16, a guess that errs towards more prompt). `running`: this queue's running requests."""
        prompting = {self._key(r) for r in running if r.num_tokens - r.num_computed_tokens > 1}
        prompting.update(self._backlog)
        ratio = 0.0
        for key in prompting - set(exclude):
            line = self._lines[key]
            ratio = max(ratio, line.typical_prompt / max(1.0, line.typical_output or 16.0))
        return ratio

    def keys(self) -> list[str | None]:
        """Every key this queue has a line for."""
        return list(self._lines)

    def backlogged_keys(self) -> list[str | None]:
        """The keys with requests waiting."""
        return list(self._backlog)

    def waiting_heads(self, keys: Collection[str | None]) -> list[Request]:
        """The head of each of these keys' lines that has requests waiting."""
        return [line.waiting[0] for line in self._backlog.values() if line.key in keys]

    def victim(
        self,
        running: list[Request],
        requester: Request | None = None,
        protected: Collection[str | None] = (),
    ) -> Request:
        """The request to preempt: the most recently admitted running request (`running` is
        in admission order) of the key with the highest counter among running requests,
        leaving out the `protected` keys' (those below their share) unless the requester is
        one of theirs: a key's decode is never preempted for a more served key's work."""
        if not self.use_keys:
            return running[-1]
        lines = self._lines
        if protected:
            own = None if requester is None else requester.fairness_key
            candidates = [
                r for r in running if r.fairness_key == own or r.fairness_key not in protected
            ]
            running = candidates or running
        top = max(lines[r.fairness_key].counter for r in running)
        return next(r for r in reversed(running) if lines[r.fairness_key].counter == top)

    def slot_victim(
        self,
        running: list[Request],
        num_slots: int,
        admissible: Callable[[Request], bool],
        below: Collection[str | None] = (),
    ) -> Request | None:
        """With every sequence slot taken: the running request to give up its slot, or None.

        A key's share of the slots is num_slots x its weight / the active keys' weights. A
        backlogged key below its share (whose next request could run at once) takes a slot
        from the key furthest above its share, its newest request, which is recomputed later
        (its full blocks stay in the prefix cache). A key never loses its last slot, nor one
        that would put it below its share: equal keys, or more keys than slots, never
        trade places step after step.

        Beyond that, a backlogged key below its share of the service (`below`, from
        `below_share`) takes a slot even at its count share, from the most served key not
        below its share that holds two or more: a light tenant's burst runs as if it were
        alone. It stops once its service reaches BELOW_SHARE of the others', and the count
        rule never takes a slot from a key below its share, so slots do not swing back.
        """
        if not self.use_keys or len(self._backlog) == 0:
            return None
        active = {line.key: line for line in self._backlog.values()}
        for request in running:
            active.setdefault(request.fairness_key, self._lines[request.fairness_key])
        if len(active) < 2:
            return None
        total = sum(line.weight for line in active.values())

        def share(line: _Line) -> float:
            return num_slots * line.weight / total

        starved = any(
            line.num_running < max(1.0, share(line)) - 1e-9 and admissible(line.waiting[0])
            for line in self._backlog.values()
        )
        if starved:
            over = [
                line
                for line in active.values()
                if line.key not in below
                and line.num_running >= 2
                and line.num_running - 1 >= share(line) - 1e-9
            ]
            if over:
                top = max(over, key=lambda line: line.num_running - share(line))
                return _newest(running, top.key)
        if not any(
            line.key in below and admissible(line.waiting[0]) for line in self._backlog.values()
        ):
            return None
        now = self.clock()
        donors = [
            line for line in active.values() if line.key not in below and line.num_running >= 2
        ]
        if not donors:
            return None
        return _newest(running, max(donors, key=lambda line: self._recent(line, now)).key)

    # -- internals --------------------------------------------------------------------------

    def _key(self, request: Request) -> str | None:
        return request.fairness_key if self.use_keys else None

    def _line(self, request: Request) -> _Line:
        key = self._key(request)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = _Line(key)
        return line

    def _now_waiting(self, line: _Line) -> None:
        """A request was just put in `line`."""
        self._backlog.setdefault(line.key, line)
        self._num_waiting += 1

    @staticmethod
    def _recent(line: _Line, now: float) -> float:
        """The line's recent service, decayed to `now`."""
        return line.recent * math.exp2((line.recent_at - now) / RATE_HALF_LIFE)

    def _floor(self) -> float:
        """Where a key returning from idle starts, at least."""
        if self._backlog:
            return min(line.counter for line in self._backlog.values())
        return 0.0 if self._last_admitted is None else self._last_admitted.counter


def _ewma(typical: float, value: int) -> float:
    return float(value) if typical == 0.0 else typical + PROMPT_EWMA * (value - typical)


def _newest(running: list[Request], key: str | None) -> Request:
    return next(r for r in reversed(running) if r.fairness_key == key)


def _priority(line: _Line) -> tuple[float, float]:
    return line.counter, line.waiting[0].arrival_time
