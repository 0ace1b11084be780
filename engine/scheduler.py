"""Decide which tokens of which requests the next forward pass computes.

One rule covers every phase: each request's num_computed_tokens catches up
with its num_tokens. A fresh prompt, a prompt chunk, a prefix-cache hit and a
recompute after preemption differ only in where num_computed_tokens starts.

Each step: running requests first (best priority band first, admission order within
one; engine/priority.py), then waiting ones,
under max_num_seqs, max_num_batched_tokens and the free KV blocks. Waiting
requests stand in one line per fairness key (engine/fairness.py): policy "fair"
admits from the least-served key first, "fcfs" in arrival order. When a running
request cannot get a block, a victim is preempted (its blocks freed, its progress
reset to recompute) until it can: the most recently admitted request of the
most-served key ("fcfs": the most recently admitted request).

Short steps while someone waits behind a flood (policy "fair"): while a key below its share
of the service is present (engine/fairness.py, `below_share`), the prompt tokens of the
other keys in a step are capped (`SchedulerOutput.prefill_cap`) so that the step takes at
most `fair_delay_ratio` times the below-share key's own first step, in time predicted from
the steps measured (engine/step_cost.py): its next request, whenever it comes, waits no
longer than that for the step under way. The cap never goes below twice the prompt tokens
the other keys' decode slots consume (their throughput holds; their first tokens wait). In
a step where a below-share key's prompt runs or is admitted, the others' prompts get none
of the budget.
The same protection covers a whole priority band while a worse one is present (`Favour`):
batch lines fill what interactive traffic leaves, in steps kept short around it.
Decode rows are never capped (another key's prompt chunk leaves each below-share decode row
its token), and with nobody below their share steps are as large as max_num_batched_tokens
allows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from engine.config import SCHEDULING_POLICIES
from engine.kv_cache.block_pool import KVCacheBlock
from engine.kv_cache.manager import KVCacheManager
from engine.lora.manager import LoRAManager
from engine.lora.types import LoRALoadError
from engine.priority import DEFAULT_MAX_WAIT, NOBODY, BandedQueue, Favour
from engine.request import Request, RequestStatus
from engine.step_cost import StepCost

# The flooding keys' prompt tokens a capped step keeps, as a multiple of what their decode
# slots consume in the steady state: slots run dry between prompts at exactly 1x, and every
# step that carries a prompt chunk pays the prompt path's fixed cost (bench fairness: 2x kept
# the demo model's flood at 527 tok/s against 505 at 1x, B's TTFT p95 unchanged).
PROMPT_NEED_MARGIN = 2.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's knobs (EngineConfig's fields of the same names; `policy` is its
    scheduling_policy)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    # "fair": priority bands, by each fairness key's service within a band; "priority":
    # bands, arrival order within them; "fcfs": arrival order (engine/priority.py).
    policy: str = "fair"
    fair_delay_ratio: float = 0.5  # see the module doc: short steps while someone waits
    priority_max_wait: float = DEFAULT_MAX_WAIT  # seconds a waiting band may go unserved

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.policy!r}"
            )
        if not self.fair_delay_ratio > 0:
            raise ValueError(f"fair_delay_ratio must be positive, got {self.fair_delay_ratio}")


@dataclass(slots=True)
class SchedulerOutput:
    # (request, number of its tokens to compute this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Waiting requests that can never run (their adapter failed to load), with why.
    failed: list[tuple[Request, str]] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Prompt tokens the keys not below their share could compute this step (None: no cap).
    prefill_cap: int | None = None
    # An interim step's (schedule_interim): a better band's prompt waits for the blocks a
    # suspended pass's rows hold.
    needs_suspended_blocks: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        config: SchedulerConfig,
        *,
        lora: LoRAManager | None = None,
        step_cost: StepCost | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv_manager
        self.lora = lora
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.policy = config.policy
        self.fair_delay_ratio = config.fair_delay_ratio
        # Measured by the engine after each step; what a step of so many tokens costs.
        self.step_cost = step_cost or StepCost()
        # Waiting requests: a band per priority, one line per fairness key in each ("fcfs":
        # one band, one line for all).
        self.waiting = BandedQueue(config.policy, config.priority_max_wait, clock)
        # This step's favoured requests (the best band's, or its keys below their share) and
        # what is left of its prefill cap.
        self._favour: Favour = NOBODY
        self._cap_left: int | None = None
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_fairness_preemptions = 0  # of num_preemptions: slots given to other keys
        # Predicates a waiting request must pass to be admitted (its grammar is
        # compiled, its adapter is loaded). A request that fails one is skipped,
        # keeps its place in line, and blocks nobody behind it.
        self.admission_gates: list[Callable[[Request], bool]] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.lora is not None:
            self.lora.begin_step()
        self._favour = self.waiting.favour()
        out.prefill_cap = self._cap_left = self._prefill_cap()
        self._schedule_running(out)
        if not out.preempted:
            self._share_slots(out)
        # Charged once preemption is settled, before admission weighs the keys' service.
        self.waiting.charge(out.scheduled)
        # Admitting new work in a step that had to preempt would only thrash.
        if not out.preempted:
            self._admit_waiting(out)
        if self.lora is not None and self.waiting:
            # Adapters of requests still waiting start loading now, not when they reach
            # the head of the line.
            self.lora.prefetch(r.lora for r in self.waiting if r.lora is not None)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> None:
        # running[:i] have been considered (planned, or yielding this step). A preemption
        # takes requests out of `running` anywhere, the one considered included: then i is
        # recounted (rare; considered requests stay a prefix of `running`).
        i = 0
        considered: set[int] = set()
        # Below-share keys' decode rows not yet planned: another key's prompt chunk leaves
        # each of them its token (with nobody below their share, chunks take what they find,
        # as they always have: the rows behind a full chunk wait a step).
        favour = self._favour
        decode_left = (
            sum(
                1 for r in self.running if r in favour and r.num_tokens - r.num_computed_tokens <= 1
            )
            if favour
            else 0
        )
        while i < len(self.running):
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                break
            request = self.running[i]
            considered.add(id(request))
            remaining = request.num_tokens - request.num_computed_tokens
            if self._cap_left == 0 and favour.whole and request not in favour:
                # A better band's prompt is due: the step is its first token's, run as if the
                # worse bands were not there (their rows wait one step).
                i += 1
                continue
            if remaining > 1:
                reserve = 0 if request in favour else decode_left
                num_new = self._capped(request, min(remaining, budget - reserve))
                if num_new <= 0:  # a prompt chunk that yields this step
                    i += 1
                    continue
            else:
                if request in favour:
                    decode_left -= 1
                num_new = min(remaining, budget)
            if request.spec_token_ids:
                # A caught-up request verifies its drafts with its last token, as many as
                # the budget takes (engine/spec_decode.py).
                del request.spec_token_ids[max(0, budget - 1) :]
                num_new += len(request.spec_token_ids)
            num_running = len(self.running)
            if self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append((request, num_new))
                out.num_batched_tokens += num_new
                self._spend(request, num_new)
            if len(self.running) == num_running:
                i += 1
            else:
                i = sum(1 for r in self.running if id(r) in considered)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.preemption_victim(request)
            if victim is not request:
                self._unschedule(out, victim)  # the fair victim may be a row planned earlier
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _allocate_or_yield(
        self,
        request: Request,
        num_new: int,
        computed_blocks: list[KVCacheBlock],
        out: SchedulerOutput,
    ) -> bool:
        """A waiting request's first blocks: where memory runs out, worse bands' running
        requests give theirs up (newest first), never a band as good as its own."""
        band_of = self.waiting.band_of
        while not self.kv.allocate_slots(request, num_new, computed_blocks):
            if not self.running or max(map(band_of, self.running)) <= band_of(request):
                return False
            victim = self.waiting.victim(self.running, request, self._favour)
            self._unschedule(out, victim)
            self.preempt(victim)
            out.preempted.append(victim)
        return True

    def _share_slots(self, out: SchedulerOutput) -> None:
        """Policy fair, every sequence slot taken: slots go from keys above their weighted
        share to backlogged keys below it (engine/fairness.py, `slot_victim`)."""
        while len(self.running) >= self.max_num_seqs:
            victim = self.waiting.slot_victim(
                self.running, self.max_num_seqs, self._admissible, self._favour
            )
            if victim is None:
                return
            self._unschedule(out, victim)
            self.preempt(victim)
            self.num_fairness_preemptions += 1

    def _admissible(self, request: Request) -> bool:
        """Could the request be admitted now, memory and budget allowing: its gates pass and
        its adapter, if any, is in a slot (no preemption waits on a load)."""
        if not all(gate(request) for gate in self.admission_gates):
            return False
        if request.lora is None:
            return True
        return self.lora is not None and request.adapter_id in self.lora.slot_of

    def _unschedule(self, out: SchedulerOutput, request: Request) -> None:
        """Take a request's row back out of the step's plan, if it has one. Allocating its
        slots published the blocks this step was to write to the prefix cache: withdraw
        them before the preemption frees them, so that no prompt can hit unwritten KV
        (today the allocation that needed them reuses them first, tail first; this does
        not depend on that)."""
        for i, (planned, num_new) in enumerate(out.scheduled):
            if planned is request:
                del out.scheduled[i]
                out.num_batched_tokens -= num_new
                self.kv.roll_back_step([(request, num_new)])
                return

    def roll_back(
        self, scheduled: list[tuple[Request, int]], failing: Collection[int] = ()
    ) -> None:
        """Undo a step that did not finish (it raised, or gave way part through): its
        requests resume from before it; the blocks it was to write leave the prefix cache, and
        a request that had hit one in the same step recomputes (preempted), unless it is
        failing anyway (`failing`: their id()s)."""
        for request in self.kv.roll_back_step(scheduled):
            if id(request) not in failing:
                self.preempt(request)

    def preemption_victim(self, requester: Request | None = None) -> Request:
        """The running request to preempt when memory runs out for `requester` (there must be
        one): never one of a key below its share for another key's work."""
        return self.waiting.victim(self.running, requester, self._favour)

    # -- the step's prefill cap -------------------------------------------------------------

    def _prefill_cap(self) -> int | None:
        """Prompt tokens the keys not below their share may compute this step: none while a
        below-share key's prompt runs or could be admitted; else as many as keep the step
        within fair_delay_ratio x that key's own first step, or as the others' decode rows
        need to stay fed, whichever is more. None: no cap (nobody below their share, policy
        fcfs, no chunking, or too few steps measured to tell)."""
        favour = self._favour
        if not favour or not self.enable_chunked_prefill:
            return None
        if self._below_share_prefill_due():
            return 0
        if not self.step_cost.fitted:
            return None
        # The step under way when the below-share key's next request comes is what it waits
        # for: at most fair_delay_ratio x its own first step...
        target = self.fair_delay_ratio * self.step_cost.predict(
            int(self.waiting.typical_prompt(favour)) or self.kv.block_size
        )
        decode_rows = sum(
            1 + len(r.spec_token_ids)
            for r in self.running
            if r.num_tokens - r.num_computed_tokens <= 1
        )
        within = self.step_cost.marginal_tokens(target - self.step_cost.predict(decode_rows))
        # ...but never so short that the other keys' decode rows run dry of prompts: their
        # throughput is kept, their first tokens wait. And at least a block a step.
        need = self.waiting.prompt_need(self.running, self.max_num_seqs, favour)
        return max(self.kv.block_size, within, int(PROMPT_NEED_MARGIN * need))

    def _below_share_prefill_due(self) -> bool:
        """Does a key below its share compute prompt tokens this step: a running prompt
        chunk, or a waiting request that could be admitted now (its gates pass, and a slot is
        free or would be given to it)?"""
        favour = self._favour
        if any(r in favour and r.num_tokens - r.num_computed_tokens > 1 for r in self.running):
            return True
        # A head whose first chunk could not get its blocks would hold the others' prompts
        # back for nothing (they might be what holds the blocks): it waits like anyone.
        free_tokens = self.kv.num_free_blocks * self.kv.block_size
        heads = [
            r
            for r in self.waiting.waiting_heads(favour)
            if self._admissible(r) and min(r.num_tokens, self.max_num_batched_tokens) <= free_tokens
        ]
        if not heads:
            return False
        if len(self.running) < self.max_num_seqs:
            return True
        victim = self.waiting.slot_victim(self.running, self.max_num_seqs, self._admissible, favour)
        return victim is not None

    def _capped(self, request: Request, num_new: int) -> int:
        """A prompt chunk of a key not below its share, cut to what is left of the cap."""
        if self._cap_left is None or request in self._favour:
            return num_new
        return min(num_new, self._cap_left)

    def _spend(self, request: Request, num_new: int) -> None:
        """Count a planned prompt chunk against the cap (decode rows never are)."""
        if (
            self._cap_left is not None
            and request not in self._favour
            and request.num_tokens - request.num_computed_tokens > 1
        ):
            self._cap_left -= num_new

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        skipped: list[Request] = []
        while len(self.running) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                break
            # With the cap spent, only the favoured are admitted.
            only = self._favour if self._cap_left == 0 else None
            request = self.waiting.pop_next(only)
            if request is None:
                break
            if not all(gate(request) for gate in self.admission_gates):
                skipped.append(request)
                continue
            if request.lora is not None:
                try:
                    slot = self._acquire_lora(request)
                except LoRALoadError as exc:
                    out.failed.append((request, str(exc)))
                    continue
                if slot is None:  # loading, or waiting for a slot to drain
                    skipped.append(request)
                    continue
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_prompt = request.num_tokens - num_cached
            fits = self.enable_chunked_prefill or num_prompt <= budget
            num_new = min(num_prompt, budget)
            if num_new > 1:
                num_new = self._capped(request, num_new)
            if not fits or not self._allocate_or_yield(request, num_new, computed_blocks, out):
                self._release_lora(request)
                self.waiting.push_front(request)
                break
            self._start(request, num_cached, num_new, out)
            self._spend(request, num_new)
        # Skipped requests keep their places: each goes back to the head of its key's line.
        for request in reversed(skipped):
            self.waiting.push_front(request)

    def _start(self, request: Request, num_cached: int, num_new: int, out: SchedulerOutput) -> None:
        """An admitted request (its blocks allocated) joins the running and the step."""
        num_prompt = request.num_tokens - num_cached
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
            request.scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.waiting.order(self.running, request)
        self.waiting.admitted(request, num_prompt if request.num_preemptions == 0 else None)
        out.scheduled.append((request, num_new))
        out.num_batched_tokens += num_new
        self.waiting.charge([(request, num_new)])  # the next pick sees this admission

    # -- while a step is suspended (engine/give_way.py) ---------------------------------------

    def schedule_interim(self, suspended: list[tuple[Request, int]], worst: int) -> SchedulerOutput:
        """A step run while `suspended`'s pass waits at a layer: the prompt work of bands
        better than `worst` (its rows' worst priority) only: the chunks left of their running
        prompts, and their waiting requests. The suspended rows hold on to what they have:
        nobody is preempted, no adapter is loaded into the pool (its layout must hold still
        under the pass; a request whose adapter is not in a slot waits for the pass's end),
        and the blocks the pass writes are out of the prefix cache already.

        A better band's request is admitted even with every sequence slot taken (the worse
        bands' rows usually hold them all; their next step gives up as many, _share_slots).
        One that needs blocks the suspended rows hold sets `needs_suspended_blocks`: the engine
        rolls the pass back for it rather than keep it waiting for the pass. Empty otherwise:
        resume the pass."""
        out = SchedulerOutput()
        held = {id(request) for request, _ in suspended}
        budget = self.max_num_batched_tokens
        for running in self.running:
            remaining = running.num_tokens - running.num_computed_tokens
            if id(running) in held or running.priority >= worst or remaining <= 1:
                continue
            num_new = min(remaining, budget - out.num_batched_tokens)
            if num_new <= 0:
                break
            if not self.kv.allocate_slots(running, num_new):
                out.needs_suspended_blocks = True
                continue
            out.scheduled.append((running, num_new))
            out.num_batched_tokens += num_new
        skipped: list[Request] = []
        while out.num_batched_tokens < budget:
            request = self.waiting.pop_better(worst)
            if request is None:
                break
            if not self._admissible(request):
                skipped.append(request)
                continue
            if request.lora is not None and self._acquire_lora(request) is None:
                skipped.append(request)  # draining for a waiting adapter
                continue
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_prompt = request.num_tokens - num_cached
            num_new = min(num_prompt, budget - out.num_batched_tokens)
            fits = self.enable_chunked_prefill or num_new == num_prompt
            if not fits or not self.kv.allocate_slots(request, num_new, computed_blocks):
                out.needs_suspended_blocks = fits
                self._release_lora(request)
                self.waiting.push_front(request)
                break
            self._start(request, num_cached, num_new, out)
        for request in reversed(skipped):
            self.waiting.push_front(request)
        return out

    def _acquire_lora(self, request: Request) -> int | None:
        assert request.lora is not None
        if self.lora is None:
            raise LoRALoadError("LoRA is not enabled on this engine")
        slot = self.lora.acquire(request.lora)
        if slot is not None:
            request.lora_slot = slot
        return slot

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot >= 0:
            assert self.lora is not None
            self.lora.release(request.lora_slot)
            request.lora_slot = -1

    def _abandon_lora_load(self, request: Request) -> None:
        """A load nobody waits for any more must not hold a place among the loads."""
        adapter_id = request.adapter_id
        if self.lora is None or adapter_id is None or request.lora_slot >= 0:
            return
        if not any(r.adapter_id == adapter_id for r in self.waiting):
            self.lora.abandon(adapter_id)

    def preempt(self, request: Request) -> None:
        """Send a running request back to recompute (its blocks freed), at the head of its
        key's line."""
        self.running.remove(request)
        self.waiting.left_running(request)
        self._release_lora(request)
        self.kv.free(request)
        request.spec_token_ids.clear()
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Within a key, earlier-admitted victims are taken last and so end up first in line.
        self.waiting.push_front(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and free its blocks (kept in the prefix cache)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.waiting.left_running(request, finished=True)
        elif not request.is_finished:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
            self._abandon_lora_load(request)
        request.status = status
        self._release_lora(request)
        self.kv.free(request)
