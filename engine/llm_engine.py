"""LLMEngine: add / step / abort, the n > 1 fan-out and admission checks. A step that
raises goes to engine/step_failure.py, the offline front end (`LLM.generate`) is
engine/frontend/offline.py."""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ContextLengthExceeded, GuidedSpecError, RequestRefused
from engine.give_way import Arrivals, StepYielded, give_way_check
from engine.guided import GrammarCache, GuidedLimits, grammar_ready
from engine.kv_cache.manager import KVCacheManager, cdiv
from engine.load_timings import LoadTimings
from engine.lora.manager import LoRAConfig, LoRAManager
from engine.lora.types import LoRALoader, LoRARequest, llama_fused_targets
from engine.messages import EngineRequest
from engine.model_runner import ModelRunner, ProgressFn
from engine.models.llama import eos_token_ids
from engine.outputs import SequenceUpdate
from engine.request import OutputKind, Owner, Request, RequestStatus, SamplingParams
from engine.sampler import SamplerOutput
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.spec_decode import NgramIndex, SpeculativeConfig, can_speculate
from engine.step_failure import Rows, StepFailures, failure_message
from kernels import quant_calibration

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sequence:
    """Engine-side bookkeeping of one sample of one caller request."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    num_sent_chars: int = 0  # of the detokenizer's text, in updates already made


@dataclass(slots=True, eq=False)
class _Suspended:
    """A step whose pass gave way mid-layers (engine/give_way.py), to be resumed."""

    sched: SchedulerOutput
    resume: Callable[[], tuple[list[Request], SamplerOutput | None]]
    worst: int  # its rows' worst priority: interim steps run better bands' prompts only
    elapsed: float  # seconds spent on it so far (the step cost it is measured at)
    rows: set[Request] = field(init=False)
    # What must wait for its end: aborts of its rows (their blocks are its), adapter loads
    # (the pool must hold still under it).
    deferred: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows = {request for request, _ in self.sched.scheduled}


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        progress: ProgressFn | None = None,
        lora_loader: LoRALoader | None = None,
        tokenizer: Any = None,
    ) -> None:
        """`tokenizer`: the model's, loaded already (a warm spare's), else loaded here."""
        self.config = config
        timings = LoadTimings()
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.tokenizer = tokenizer
        hf_config = AutoConfig.from_pretrained(config.model)
        self.hf_config = hf_config
        self.max_model_len = config.max_model_len or int(hf_config.max_position_embeddings)
        self.vocab_size = int(hf_config.vocab_size)
        self.eos_token_ids = eos_token_ids(hf_config, self.tokenizer, config.model)

        calibration = None
        if config.quantization is not None:
            calibration = quant_calibration.token_batches(self.tokenizer, self.max_model_len)
        timings.mark("tokenizer")
        self.runner = ModelRunner(
            config, hf_config, self.max_model_len, progress, calibration, timings
        )
        num_blocks = self.runner.num_blocks_for_memory()
        capacity = num_blocks * config.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than "
                f"max_model_len={self.max_model_len}: raise kv_cache_memory or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        timings.mark("kv")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            lora_config = LoRAConfig(
                config.max_loras, config.max_lora_rank, config.max_cpu_loras, config.lora_memory
            )
            self.lora = LoRAManager(
                llama_fused_targets(hf_config),
                self.runner.num_layers,
                lora_config,
                loader=lora_loader,
                kernels=self.runner.kernels,
                dtype=self.runner.dtype,
            )
            self.runner.lora = self.lora
            logger.info(
                "LoRA pool: %.1f MiB (%s), %d rank units: %d adapters of rank %d, at most %d "
                "resident; %d more kept in CPU memory",
                self.lora.pool_bytes / 2**20,
                self.runner.dtype,
                self.lora.pool.num_units,
                self.lora.pool.num_units // config.max_lora_rank,
                config.max_lora_rank,
                config.max_loras,
                config.max_cpu_loras,
            )
        scheduling = SchedulerConfig(
            config.max_num_seqs,
            self.runner.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.scheduling_policy,
            config.fair_delay_ratio,
            config.priority_max_wait,
        )
        self.scheduler = Scheduler(self.kv, scheduling, lora=self.lora)
        self.sequences: dict[str, _Sequence] = {}
        self.parents: dict[str, list[str]] = {}
        self.grammars = grammar_cache(config, self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.scheduler.admission_gates.append(grammar_ready)
        # Guided sequences whose matcher does not exist yet (compiling, or not looked at).
        self._awaiting_grammar: dict[str, _Sequence] = {}
        self.num_failed_requests = 0  # sequences a failed step was pinned on
        self.step_failures = StepFailures(self._run_rows, self.scheduler)
        # Requests sent and not yet taken in, noted by the loop that feeds this engine: a step
        # of worse bands gives way to a better one's (engine/give_way.py).
        self.arrivals = Arrivals()
        self.num_yielded_steps = 0
        self.num_rolled_back_steps = 0  # of those, given up for a prompt that needed their blocks
        self._suspended: _Suspended | None = None
        # Speculative decoding: its config, and vLLM's counters (drafts proposed and
        # verified, their tokens, the tokens accepted).
        self.speculative = config.speculative_config
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max concurrency at "
            "max_model_len=%d: %.1fx",
            num_blocks,
            config.block_size,
            capacity,
            num_blocks * self.runner.bytes_per_block / 2**20,
            self.runner.dtype,
            self.max_model_len,
            capacity / self.max_model_len,
        )
        timings.mark("rest")
        self.load_seconds = timings.seconds  # where the start went, by phase

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        lora: LoRARequest | None = None,
    ) -> list[int]:
        """vLLM's offline spelling of `add`, for a request of nobody in particular; a
        tenant's (its cache salt, fairness key and weight) is an EngineRequest for `add`."""
        return self.add(EngineRequest(request_id, prompt, params, lora))

    def add(self, request: EngineRequest, received_at: float | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises RequestRefused (a
        ValueError; ContextLengthExceeded, GuidedSpecError, ...) for a request that could
        never run, which the gateway answers with HTTP 400 and the refusal's code.

        `received_at` (time.monotonic(), now if None): when the loop feeding the engine
        received it, its arrival. A request that comes while a step runs is taken in when the
        step ends or gives way; its queue time counts that wait too, as vLLM's does.

        The request's fairness key (a tenant) and weight (its share under contention,
        relative to other keys') steer the "fair" scheduling policy; requests without a
        key share one."""
        request_id, params = request.request_id, request.params
        if request_id in self.parents:
            raise RequestRefused(f"request id {request_id!r} is already running")
        fairness_weight = request.fairness_weight
        if not (math.isfinite(fairness_weight) and fairness_weight > 0):
            raise RequestRefused(f"fairness_weight must be positive, got {fairness_weight}")
        if not isinstance(request.priority, int) or isinstance(request.priority, bool):
            raise RequestRefused(f"priority must be an integer, got {request.priority!r}")
        prompt_ids = self.tokenize(request.prompt)
        self._validate(prompt_ids, params)
        if request.lora is not None and self.lora is None:
            raise RequestRefused("LoRA adapters are not enabled on this engine")
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - len(prompt_ids))
        eos = None if not self.eos_token_ids else min(self.eos_token_ids)
        compiled = None if params.guided is None else self.grammars.submit(params.guided)
        owner = Owner(request.lora, request.cache_salt, request.fairness_key, fairness_weight)
        child_ids = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else (params.seed + index) & (2**64 - 1)
                child_params = replace(params, n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child = Request(
                child_id, prompt_ids, child_params, eos, owner, priority=request.priority
            )
            if received_at is not None:
                child.arrival_time = received_at
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, child_params.stop, child_params.skip_special_tokens
            )
            self.sequences[child_id] = _Sequence(child, request_id, index, detok)
            if compiled is not None:
                child.grammar = self.grammars.sequence_grammar(compiled)
                self._awaiting_grammar[child_id] = self.sequences[child_id]
            self.scheduler.add_request(child)
            child_ids.append(child_id)
        self.parents[request_id] = child_ids
        return prompt_ids

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.verify()
        if not prompt_ids:
            raise RequestRefused("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise RequestRefused(f"prompt token ids must be in [0, {self.vocab_size})")
        out_of_vocab = [t for t in params.stop_token_ids if t >= self.vocab_size]
        out_of_vocab += [t for t in params.logit_bias or () if t >= self.vocab_size]
        if out_of_vocab:
            raise RequestRefused(
                f"token id {out_of_vocab[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max(1, max_tokens) > self.max_model_len:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {len(prompt_ids)} prompt tokens plus {max_tokens} output tokens"
            )
        # Every sample may need its whole length at once; a request that could never
        # hold them all is refused, not left to preempt itself forever.
        blocks = params.n * cdiv(len(prompt_ids) + max_tokens, self.config.block_size)
        if blocks > self.kv.pool.num_blocks:
            raise RequestRefused(
                f"n={params.n} samples of up to {len(prompt_ids) + max_tokens} tokens need "
                f"{blocks} KV blocks; the cache holds {self.kv.pool.num_blocks}: lower n or "
                "max_tokens"
            )

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool at once, or, where a suspended
        step's pass holds some of its rows (engine/give_way.py), when that pass ends."""
        suspended = self._suspended
        if suspended is not None and any(
            self.sequences[child_id].request in suspended.rows
            for child_id in self.parents.get(request_id, [])
        ):
            suspended.deferred.append(functools.partial(self.abort, request_id))
            return
        for child_id in self.parents.pop(request_id, []):
            seq = self.sequences.pop(child_id)
            self._awaiting_grammar.pop(child_id, None)
            self.scheduler.finish(seq.request, RequestStatus.FINISHED_ABORTED)

    def load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter into the pool now (a LoadLoRA message), or, while a suspended pass
        runs on the pool's layout, when that pass ends; a failure is logged (a request naming
        the adapter fails with the reason)."""
        if self.lora is None:
            return
        if self._suspended is not None:
            self._suspended.deferred.append(functools.partial(self.load_lora, lora))
            return
        try:
            self.lora.load_now(lora)
        except Exception:  # noqa: BLE001 - a request naming it fails with the reason
            logger.exception("adapter %s did not load", lora.adapter_id)

    def fail_running(self) -> list[str]:
        """The last resort, after the step loop raised outside the forward pass (whose
        failures `step` pins on their requests): the running requests' new KV may be
        half-written. Drops their blocks from the prefix cache, aborts every request that
        had a sequence running, and returns those request ids.
        """
        self._suspended = None  # its rows are among the running
        parents = {self.sequences[r.request_id].parent_id for r in self.scheduler.running}
        for request in self.scheduler.running:
            self.kv.uncache(request)
        for parent in parents:
            self.abort(parent)
        return sorted(parents)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[SequenceUpdate]:
        start = time.perf_counter()
        updates = self._start_grammars() if self._awaiting_grammar else []
        suspended = self._suspended
        if suspended is not None:
            interim = self.scheduler.schedule_interim(suspended.sched.scheduled, suspended.worst)
            if not (interim.is_empty and interim.needs_suspended_blocks):
                return updates + self._step_while_suspended(suspended, interim)
            self._roll_back_suspended(suspended)  # then a step that may preempt for it
        sched = self.scheduler.schedule()
        updates += [self._fail(request, error) for request, error in sched.failed]
        if sched.is_empty:
            if not updates:
                # Every waiting request waits on a background job (an adapter load, a
                # grammar compile): give those threads the GIL instead of spinning.
                time.sleep(0.001)
            return updates
        try:
            sampled, sampler_out = self.runner.execute(sched, self.kv, self._give_way(sched))
        except StepYielded as yielded:
            self._suspend(sched, yielded, time.perf_counter() - start)
            return updates
        except Exception as exc:  # noqa: BLE001 - fail the requests that cause it, alone
            return updates + self._fail_step(sched.scheduled, exc)
        return updates + self._end_step(sched, sampled, sampler_out, start)

    def _end_step(
        self,
        sched: SchedulerOutput,
        sampled: list[Request],
        sampler_out: SamplerOutput | None,
        start: float,
    ) -> list[SequenceUpdate]:
        """A step's pass ended (begun at `start`, as perf_counter tells): its tokens appended,
        drafts proposed for the next, its cost measured."""
        updates = self._complete(sched, sampled, sampler_out)
        if self.speculative is not None:
            self._propose_drafts(self.speculative)
        self.scheduler.step_cost.observe(sched.num_batched_tokens, time.perf_counter() - start)
        return updates

    def _complete(
        self, sched: SchedulerOutput, sampled: list[Request], sampler_out: SamplerOutput | None
    ) -> list[SequenceUpdate]:
        """A step's forward pass ended: its rows' tokens are computed, the sampled appended."""
        self.step_failures.step_succeeded()
        for request, num_new in sched.scheduled:
            request.num_computed_tokens += num_new
        if sampler_out is None:
            return []
        return self._append_sampled(sampled, sampler_out)

    # -- a step that gave way (engine/give_way.py) -------------------------------------------

    def _suspend(self, sched: SchedulerOutput, yielded: StepYielded, elapsed: float) -> None:
        """Keep a pass that gave way for later; the blocks it writes leave the prefix cache
        until it ends (its rows keep them, and hits on them within it stay valid)."""
        self.kv.roll_back_step(sched.scheduled)
        worst = max(request.priority for request, _ in sched.scheduled)
        self._suspended = _Suspended(sched, yielded.resume, worst, elapsed)
        self.num_yielded_steps += 1

    def _step_while_suspended(
        self, suspended: _Suspended, interim: SchedulerOutput
    ) -> list[SequenceUpdate]:
        """A better band's prompts due: an interim step of them alone. Else the suspended
        pass runs on from its layer (and may give way again)."""
        start = time.perf_counter()
        if not interim.is_empty:
            try:
                sampled, sampler_out = self.runner.execute(interim, self.kv)
            except Exception as exc:  # noqa: BLE001 - as in step: the culprits fail alone
                return self._fail_step(interim.scheduled, exc)
            # No drafts are proposed: the suspended rows' must stay as their pass saw them.
            updates = self._complete(interim, sampled, sampler_out)
            elapsed = time.perf_counter() - start
            self.scheduler.step_cost.observe(interim.num_batched_tokens, elapsed)
            return updates
        sched = suspended.sched
        try:
            sampled, sampler_out = suspended.resume()
        except StepYielded as again:
            suspended.resume = again.resume
            suspended.elapsed += time.perf_counter() - start
            self.num_yielded_steps += 1
            return []
        except Exception as exc:  # noqa: BLE001 - fail the requests that cause it, alone
            self._suspended = None
            failed = self._fail_step(sched.scheduled, exc)
            self._run_deferred(suspended)
            return failed
        self._suspended = None
        for request, num_new in sched.scheduled:
            self.kv.publish_written(request, request.num_computed_tokens + num_new)
        # Measured at its own time: what it ran before and after the interim steps.
        updates = self._end_step(sched, sampled, sampler_out, start - suspended.elapsed)
        self._run_deferred(suspended)
        return updates

    def _roll_back_suspended(self, suspended: _Suspended) -> None:
        """Give a suspended pass up (its rows compute the step again later), as a step that
        raised is rolled back: a better band's prompt needs its rows' blocks."""
        self._suspended = None
        self.scheduler.roll_back(suspended.sched.scheduled)
        self.num_rolled_back_steps += 1
        self._run_deferred(suspended)

    def _run_deferred(self, suspended: _Suspended) -> None:
        """What waited for the suspended pass to end."""
        for action in suspended.deferred:
            action()

    def _give_way(self, sched: SchedulerOutput) -> Callable[[], bool] | None:
        """Between its layers, may this step stop for a better band's request? Not when
        turned off, nor under policy fcfs, where `priority` is ignored."""
        if not (self.config.priority_step_yield and self.scheduler.waiting.banded):
            return None
        return give_way_check(self.arrivals, (r.priority for r, _ in sched.scheduled))

    def _append_sampled(
        self, sampled: list[Request], sampler_out: SamplerOutput
    ) -> list[SequenceUpdate]:
        updates = []
        now = time.monotonic()
        accepted = sampler_out.accepted_drafts or itertools.repeat((), len(sampled))
        for request, token_id, logprobs, drafts in zip(
            sampled, sampler_out.token_ids, sampler_out.logprobs, accepted, strict=True
        ):
            seq = self.sequences[request.request_id]
            speculated = bool(request.spec_token_ids)
            if speculated:
                # The step computed every draft; only the accepted ones' KV stands.
                request.num_computed_tokens -= len(request.spec_token_ids) - len(drafts)
                self.num_draft_tokens += len(request.spec_token_ids)
                self.num_accepted_tokens += len(drafts)
                self.num_drafts += 1
                request.spec_token_ids = []
            try:
                update = self._append_tokens(seq, [*drafts, token_id], logprobs, now)
            except Exception as exc:  # noqa: BLE001 - a stop check or detokenizer failure
                logger.exception("request %s failed after its step", seq.parent_id)
                self.num_failed_requests += 1
                updates.append(self._fail(request, failure_message(exc)))
                continue
            if update is not None:
                updates.append(update)
            if speculated and not request.is_finished:
                self.kv.trim(request, request.num_tokens)  # the rejected drafts' blocks
        return updates

    def _propose_drafts(self, config: SpeculativeConfig) -> None:
        """Drafts for every caught-up running request that may speculate (spec_decode)."""
        for request in self.scheduler.running:
            if request.num_computed_tokens + 1 != request.num_tokens or not can_speculate(request):
                continue
            if request.ngram_index is None:
                request.ngram_index = NgramIndex(config)
            params = request.sampling_params
            assert params.max_tokens is not None
            limit = min(
                params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            request.spec_token_ids = request.ngram_index.propose(request.all_token_ids, limit)

    def _append_tokens(
        self,
        seq: _Sequence,
        token_ids: list[int],
        logprobs: dict[int, float] | None,
        now: float,
    ) -> SequenceUpdate | None:
        """Append a step's tokens (one, or accepted drafts and one), checking the stop
        conditions after each: tokens after a stop are dropped. Their update, or None for a
        FINAL_ONLY request that goes on (the request keeps them for its one update)."""
        request = seq.request
        if request.first_token_time is None:
            request.first_token_time = now
        if logprobs is not None and request.logprobs is not None:
            request.logprobs.append(logprobs)
        appended = []
        for token_id in token_ids:
            request.all_token_ids.append(token_id)
            appended.append(token_id)
            status = self._check_stop(seq, token_id)
            if status is not None:
                self._finish(seq, status)
                break
        if request.sampling_params.output_kind is OutputKind.FINAL_ONLY and not request.is_finished:
            return None
        return self._update(seq, appended, logprobs)

    def _fail_step(self, scheduled: Rows, error: Exception) -> list[SequenceUpdate]:
        """A step raised: only the requests that make it fail end (engine/step_failure.py)."""
        culprits = self.step_failures.contain(scheduled, error)
        for request, exc in culprits:
            logger.error(
                "request %s failed the engine step; it alone fails",
                self.sequences[request.request_id].parent_id,
                exc_info=exc,
            )
        self.num_failed_requests += len(culprits)
        return [self._fail(request, failure_message(exc)) for request, exc in culprits]

    def _run_rows(self, rows: Rows) -> None:
        """A diagnostic forward of some of a failed step's rows; raises as they do."""
        num_tokens = sum(n for _, n in rows)
        self.runner.execute(SchedulerOutput(scheduled=rows, num_batched_tokens=num_tokens), self.kv)

    def _start_grammars(self) -> list[SequenceUpdate]:
        """Give each guided sequence whose grammar compiled its matcher (the admission gate
        then lets it in); fail those whose compile failed or timed out; forget finished ones
        (an adapter that failed to load ends a request before its grammar is ready)."""
        updates = []
        now = time.monotonic()
        for child_id, seq in list(self._awaiting_grammar.items()):
            request = seq.request
            assert request.grammar is not None
            try:
                if not (request.is_finished or request.grammar.try_start(now)):
                    continue
            except GuidedSpecError as exc:
                updates.append(self._fail(request, str(exc)))
            del self._awaiting_grammar[child_id]
        return updates

    def _check_stop(self, seq: _Sequence, token_id: int) -> RequestStatus | None:
        request = seq.request
        params = request.sampling_params
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token_id):
            request.error = f"token {token_id} is outside the grammar"  # a masking bug
            return RequestStatus.FINISHED_ERROR
        # Below min_tokens no stop condition but length applies (as in vLLM).
        if request.num_output_tokens < params.min_tokens:
            seq.detokenizer.append(token_id)
        else:
            stop_string = seq.detokenizer.update(token_id)
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_string is not None:
                request.stop_reason = stop_string
                return RequestStatus.FINISHED_STOPPED
        # The grammar's end is the output's end, whatever min_tokens or ignore_eos say.
        if grammar is not None and grammar.must_end():
            return RequestStatus.FINISHED_STOPPED
        assert params.max_tokens is not None
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fail(self, request: Request, error: str) -> SequenceUpdate:
        """A request that can never run, or that failed: finish it with an error update."""
        seq = self.sequences[request.request_id]
        request.error = error
        self._finish(seq, RequestStatus.FINISHED_ERROR)
        return self._update(seq, [], None)

    def _finish(self, seq: _Sequence, status: RequestStatus) -> None:
        self.scheduler.finish(seq.request, status)
        del self.sequences[seq.request.request_id]
        siblings = self.parents[seq.parent_id]
        siblings.remove(seq.request.request_id)
        if not siblings:
            del self.parents[seq.parent_id]

    @staticmethod
    def _update(
        seq: _Sequence, token_ids: list[int], logprobs: dict[int, float] | None
    ) -> SequenceUpdate:
        """The sequence's update: `token_ids` and `logprobs` are this step's. A FINAL_ONLY
        request's one update, at its end, carries every token and logprob it made instead."""
        request = seq.request
        detok = seq.detokenizer
        finished = request.is_finished
        # Held-back text is never sent, so a stop string found later cuts only unsent text.
        safe = len(detok.text) if finished else detok.num_stream_safe_chars
        delta = detok.text[seq.num_sent_chars : safe]
        seq.num_sent_chars = max(seq.num_sent_chars, safe)
        new_logprobs = None if logprobs is None else [logprobs]
        decode_time = 0.0
        if request.sampling_params.output_kind is OutputKind.FINAL_ONLY:
            token_ids, new_logprobs = request.output_token_ids, request.logprobs
            if request.first_token_time is not None:
                decode_time = time.monotonic() - request.first_token_time
        return SequenceUpdate(
            request_id=seq.parent_id,
            index=seq.index,
            new_token_ids=token_ids,
            text_delta=delta,
            new_logprobs=new_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            queue_time=(request.scheduled_time or request.arrival_time) - request.arrival_time,
            decode_time=decode_time,
            finish_reason=request.finish_reason if finished else None,
            stop_reason=request.stop_reason,
            error=request.error,
        )


def grammar_cache(
    config: EngineConfig, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]
) -> GrammarCache:
    limits = GuidedLimits(
        config.guided_cache_size,
        config.guided_max_schema_bytes,
        config.guided_max_schema_depth,
        config.guided_compile_timeout,
    )
    return GrammarCache(tokenizer, vocab_size, sorted(eos_token_ids), limits)
