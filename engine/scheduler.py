"""Decide which tokens of which requests the next forward pass computes.

One rule covers every phase: each request's num_computed_tokens catches up
with its num_tokens. A fresh prompt, a prompt chunk, a prefix-cache hit and a
recompute after preemption differ only in where num_computed_tokens starts.

Each step: running requests first (in admission order), then waiting ones,
under max_num_seqs, max_num_batched_tokens and the free KV blocks. When a
running request cannot get a block, the most recently admitted request is
preempted (its blocks freed, its progress reset to recompute) until it can.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache.manager import KVCacheManager
from engine.lora import LoRALoadError, LoRAManager
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
    ) -> None:
        self.kv = kv_manager
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Predicates a waiting request must pass to be admitted (its grammar is
        # compiled, its adapter is loaded). A request that fails one is skipped,
        # keeps its place in line, and blocks nobody behind it.
        self.admission_gates: list[Callable[[Request], bool]] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.lora is not None:
            self.lora.begin_step()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # Admitting new work in a step that had to preempt would only thrash.
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
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
                self.waiting.appendleft(request)
                break
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

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
        """Send a running request back to recompute (its blocks freed)."""
        self.running.remove(request)
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self._release_lora(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Earlier-admitted victims are popped last and so end up first in line.
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and free its blocks (kept in the prefix cache)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
            self._abandon_lora_load(request)
        request.status = status
        self._release_lora(request)
        self.kv.free(request)
