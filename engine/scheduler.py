"""Decide which tokens of which requests the next forward pass computes.

One rule covers every phase: each request's num_computed_tokens catches up
with its num_tokens. A fresh prompt, a prompt chunk, a prefix-cache hit and a
recompute after preemption differ only in where num_computed_tokens starts.

Each step: running requests first (in admission order), then waiting ones,
under max_num_seqs, max_num_batched_tokens and the free KV blocks. Waiting
requests stand in one line per fairness key (engine/fairness.py): policy "fair"
admits from the least-served key first, "fcfs" in arrival order. When a running
request cannot get a block, a victim is preempted (its blocks freed, its progress
reset to recompute) until it can: the most recently admitted request of the
most-served key ("fcfs": the most recently admitted request).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import SCHEDULING_POLICIES
from engine.fairness import FairQueue
from engine.kv_cache.manager import KVCacheManager
from engine.lora import LoRAManager
from engine.lora_types import LoRALoadError
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    # (request, number of its tokens to compute this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Waiting requests that can never run (their adapter failed to load), with why.
    failed: list[tuple[Request, str]] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        lora: LoRAManager | None = None,
        policy: str = "fair",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be fair or fcfs, got {policy!r}")
        self.kv = kv_manager
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        # Waiting requests, in one line per fairness key ("fcfs": one line for all).
        self.waiting = FairQueue(use_keys=policy == "fair")
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
        self._schedule_running(out)
        if not out.preempted:
            self._share_slots(out)
        # Charged once preemption is settled, before admission weighs the keys' service.
        self.waiting.charge(out.scheduled)
        # Admitting new work in a step that had to preempt would only thrash.
        if not out.preempted:
            self._admit_waiting(out)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> None:
        # Invariant: running[:len(out.scheduled)] are the rows scheduled so far, in order
        # (a victim taken back from out.scheduled leaves both lists).
        while len(out.scheduled) < len(self.running):
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                break
            request = self.running[len(out.scheduled)]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.spec_token_ids:
                # A caught-up request verifies its drafts with its last token, as many as
                # the budget takes (engine/spec_decode.py).
                del request.spec_token_ids[max(0, budget - 1) :]
                num_new += len(request.spec_token_ids)
            if self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append((request, num_new))
                out.num_batched_tokens += num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.preemption_victim()
            if victim is not request:
                self._unschedule(out, victim)  # the fair victim may be a row planned earlier
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _share_slots(self, out: SchedulerOutput) -> None:
        """Policy fair, every sequence slot taken: slots go from keys above their weighted
        share to backlogged keys below it (engine/fairness.py, `slot_victim`)."""
        while len(self.running) >= self.max_num_seqs:
            victim = self.waiting.slot_victim(self.running, self.max_num_seqs, self._admissible)
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
        return self.lora is not None and any(
            s.adapter_id == request.adapter_id for s in self.lora.slots
        )

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

    def preemption_victim(self) -> Request:
        """The running request to preempt when memory runs out (there must be one)."""
        return self.waiting.victim(self.running)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        skipped: list[Request] = []
        while len(self.running) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                break
            request = self.waiting.pop_next()
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
            num_new = request.num_tokens - num_cached
            fits = self.enable_chunked_prefill or num_new <= budget
            num_new = min(num_new, budget)
            if not fits or not self.kv.allocate_slots(request, num_new, computed_blocks):
                self._release_lora(request)
                self.waiting.push_front(request)
                break
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.waiting.admitted(request)
            out.scheduled.append((request, num_new))
            out.num_batched_tokens += num_new
            self.waiting.charge([(request, num_new)])  # the next pick sees this admission
        # Skipped requests keep their places: each goes back to the head of its key's line.
        for request in reversed(skipped):
            self.waiting.push_front(request)

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
            self.waiting.left_running(request)
        elif not request.is_finished:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
            self._abandon_lora_load(request)
        request.status = status
        self._release_lora(request)
        self.kv.free(request)
